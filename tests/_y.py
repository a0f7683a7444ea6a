import torch
torch.manual_seed(0)
p=torch.randn(1003); q=p.clone(); g=torch.randn(1003)
b=torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1); q.grad=g.clone(); b.step()
lr,wd,b1,b2,eps=1e-2,0.1,0.9,0.999,1e-8
m=torch.zeros(1003); v=torch.zeros(1003)
x=p.clone(); x.mul_(1-lr*wd); m.lerp_(g,1-b1); v.mul_(b2).addcmul_(g,g,value=1-b2)
bc1=1-b1**1; bc2=1-b2**1
denom=(v.sqrt()/(bc2**0.5)).add_(eps); x.addcdiv_(m,denom,value=-lr/bc1)
print("single formula diffs", (x!=q).sum().item())
import torch.optim.adam as A, inspect
src=inspect.getsource(A._multi_tensor_adam)
print(src[src.find("bias_correction1 ="):][:1500])
