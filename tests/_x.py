import torch
from hf_zero.ops import CPUAdam
for N in (1003, 10007):
 for betas in ((0.9,0.999),(0.9,0.99)):
  for adamw in (True, False):
    gen = torch.Generator().manual_seed(0)
    p=torch.randn(N, generator=gen); q=p.clone()
    a=CPUAdam([p], lr=1e-2, betas=betas, weight_decay=0.1, adamw_mode=adamw)
    b=(torch.optim.AdamW if adamw else torch.optim.Adam)([q], lr=1e-2, betas=betas, weight_decay=0.1)
    for s in range(5):
      g=torch.randn(N, generator=gen)*3; p.grad=g.clone(); q.grad=g.clone(); a.step(); b.step()
    d=(p-q).abs(); print(N, betas, adamw, (d>0).sum().item(), d.max().item(), (d>0).nonzero()[:5].flatten().tolist())
