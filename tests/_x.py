import torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, BertConfig, BertForSequenceClassification
import hf_zero
from hf_zero.launch import spawn_gloo
from hf_zero.tensor_parallel import init_mesh, apply_tensor_parallel
from tests.helpers import batch, make_optimizer
from torch.distributed.tensor import DTensor

def model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=96, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))

def run(kind, tp, config, steps=5):
    m = model(kind)
    mesh = None
    rank, dp = 0, 1
    if tp:
        mesh = init_mesh(tp)
        apply_tensor_parallel(m, mesh["tp"])
        rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    engine = hf_zero.initialize(m, make_optimizer(m), config, mesh=mesh)
    losses, norms = [], []
    for step in range(steps):
        b = {k: v.chunk(dp)[rank] for k, v in batch(kind, step, 8).items()}
        out = engine(**b)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item()); norms.append(engine.global_grad_norm)
    with engine.gathered_parameters():
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in m.named_parameters()}
    return losses, norms, params, dict(engine.ledger.last_step_elements)

if __name__ == "__main__":
    import sys
    kind = sys.argv[1]
    for stage in (0, 1, 2, 3):
        cfg = {"zero_stage": stage, "gradient_clipping": 0.5, "reduce_bucket_size": 3000, "allgather_bucket_size": 6000}
        ref = run(kind, 0, cfg)
        for tp in (2, 4):
            res = spawn_gloo(run, 4, kind, tp, cfg)
            r = res[0]
            print(kind, stage, tp, max(abs(a-b) for a, b in zip(r[1], ref[1])), max((r[2][n]-ref[2][n]).abs().max().item() for n in ref[2]), r[3])
