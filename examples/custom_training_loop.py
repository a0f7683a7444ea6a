"""Your own training loop with hf_zero: the three calls that replace loss.backward() / optimizer.step().

    torchrun --nproc_per_node 2 examples/custom_training_loop.py --zero_stage 3
    python examples/custom_training_loop.py            # one process, no process group needed

Trains the zoo's tiny byte-level GPT-2 on Python's documentation (pydoc_data.topics, ships with CPython).
"""
import argparse

import torch
import torch.distributed as dist

import hf_zero
import model_zoo
from hf_zero.cli.train_lm import batches, load_text
from hf_zero.runtime.launch import init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--zero_stage", type=int, default=2)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

init_distributed()
rank = dist.get_rank() if dist.is_initialized() else 0
torch.manual_seed(0)  # every rank builds the same model; the engine also broadcasts rank 0's weights
model = model_zoo.build("gpt2-tiny")
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
engine = hf_zero.initialize(model, optimizer, {"zero_stage": args.zero_stage, "gradient_clipping": 1.0})

text = torch.frombuffer(bytearray(load_text(None)), dtype=torch.uint8).long()
for step, x in zip(range(args.steps), batches(text, batch_size=8, seq_len=65, seed=rank)):
    loss = engine(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    engine.backward(loss)
    engine.step()
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {loss.item():.3f}, global grad norm {engine.global_grad_norm:.3f}")
print(engine.ledger.report())
if dist.is_initialized():
    dist.destroy_process_group()
