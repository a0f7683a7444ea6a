import torch, hf_zero
from tests.helpers import tiny_model, make_optimizer, batch, named_copy, max_diff
for clip in (0.0, 0.5):
  res={}
  for name, cfg in [("plain", {}), ("off", {"offload_optimizer": "cpu"})]:
    model=tiny_model("gpt2"); eng=hf_zero.initialize(model, make_optimizer(model), {"zero_stage":1, "gradient_clipping": clip, **cfg})
    res[name]=[]
    for step in range(4):
        b=batch("gpt2", step, 8); eng.backward(eng(**b).loss); eng.step()
        res[name].append((named_copy(model), eng.global_grad_norm))
  for s in range(4):
    a,b=res["plain"][s], res["off"][s]
    print(clip, s, max_diff(a[0], b[0]), a[1], b[1])
