import torch
from hf_zero.ops import CPUAdam
gen=torch.Generator().manual_seed(0)
N=100000
p=torch.randn(N, generator=gen)*0.02; q=p.clone(); p0=p.clone()
a=CPUAdam([p], lr=1e-3, weight_decay=0.1); b=torch.optim.AdamW([q], lr=1e-3, weight_decay=0.1)
g=torch.randn(N, generator=gen); p.grad=g.clone(); q.grad=g.clone(); a.step(); b.step()
idx=(p!=q).nonzero().flatten(); print(len(idx), idx[:10].tolist())
# emulate torch ops on the whole tensor
x=p0.clone(); m=torch.zeros(N); v=torch.zeros(N)
x.mul_(1-1e-3*0.1); m.lerp_(g,0.1); v.mul_(0.999).addcmul_(g,g,value=1-0.999)
d=(v.sqrt()/((1-0.999)**0.5)).add_(1e-8); x.addcdiv_(m,d,value=-1e-3/(1-0.9))
print("emul==torch", (x!=q).sum().item())
# now emulate on a slice of 1000 around idx
i=idx[0].item(); lo=i-(i%64)
x2=p0[lo:lo+64].clone(); m2=torch.zeros(64); v2=torch.zeros(64); g2=g[lo:lo+64]
x2.mul_(1-1e-3*0.1); m2.lerp_(g2,0.1); v2.mul_(0.999).addcmul_(g2,g2,value=1-0.999)
d2=(v2.sqrt()/((1-0.999)**0.5)).add_(1e-8); x2.addcdiv_(m2,d2,value=-1e-3/(1-0.9))
print("slice emul vs torch", (x2!=q[lo:lo+64]).sum().item(), "vs ours", (x2!=p[lo:lo+64]).sum().item())
st=a.state[p]; tq=b.state[q]
print("m diff", (st["exp_avg"]!=tq["exp_avg"]).sum().item(), "v diff", (st["exp_avg_sq"]!=tq["exp_avg_sq"]).sum().item())
j=idx[0].item()
print(repr(g[j].item()), st["exp_avg_sq"][j].item(), tq["exp_avg_sq"][j].item())
gg=torch.tensor([g[j].item()]); 
print("(0.001*g)*g fma:", ((torch.tensor(0.001).double()*gg.double()).float().double()*gg.double()).float().item(), " g*g*0.001:", (gg*gg*0.001).item(), "0.001*(g*g)", (0.001*(gg*gg)).item())
f=lambda x: torch.tensor([x], dtype=torch.float32)
P0=p0[j:j+1]; M=st["exp_avg"][j:j+1]; V=st["exp_avg_sq"][j:j+1]
dec=P0*f(1-1e-3*0.1)
den=torch.sqrt(V)/f((1-0.999)**0.5)+f(1e-8)
ours_emul=dec+(f(-1e-3/(1-0.9))*M)/den
print("ours", p[j].item(), "torch", q[j].item(), "emul-ours", ours_emul.item())
den_t=(V.sqrt()/((1-0.999)**0.5)).add_(1e-8); x=dec.clone().addcdiv_(M, den_t, value=-1e-3/(1-0.9)); print("torch-emul", x.item())
print("den", den.item(), den_t.item())
from hf_zero.ops import cpu_adam_kernel
k=cpu_adam_kernel()
P=P0.clone(); Mz=torch.zeros(1); Vz=torch.zeros(1); G=g[j:j+1].clone()
k.adam_step(P, G, Mz, Vz, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, True, 1.0)
print("single", P.item(), Mz.item()==M.item(), Vz.item()==V.item())
P=P0.clone(); Mz=torch.zeros(1); Vz=torch.zeros(1)
k.adam_step(P, G, Mz, Vz, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0)
print("no decay", P.item(), (P0+(f(-1e-3/(1-0.9))*M)/den).item())
ss=f(-1e-3/(1-0.9))
print("a", (P0+ss*(M/den)).item(), "b", (P0+(ss*M)/den).item(), "c fma", ((ss*M).double()/den.double()+P0.double()).float().item())
print("M", M.item(), "den", den.item(), "V", V.item())
import numpy as np
out=P.item()
for dd in (-2,-1,0,1,2):
    dn=torch.nextafter(den, torch.tensor([1e9]) if dd>0 else torch.tensor([-1e9]))
    d2=den.clone()
    for _ in range(abs(dd)): d2=torch.nextafter(d2, torch.tensor([1e9]) if dd>0 else torch.tensor([-1e9]))
    print(dd, (P0+(ss*M)/d2).item()==out)
for sd in (-1,1):
    s2=torch.nextafter(ss, torch.tensor([1.0]) if sd>0 else torch.tensor([-1.0]))
    print("ss", sd, (P0+(s2*M)/den).item()==out)
print("sqrt", torch.sqrt(V).item(), "c", f((1-0.999)**0.5).item())
