// The Adam/AdamW update over [begin, end) of one tensor, for one instruction set.
//
// Included once per instruction set (see cpu_adam.cpp), inside a namespace that defines the vector
// type `V`, its width `W` and load/store/arithmetic helpers, so all ISAs share one formula. The
// arithmetic follows torch.optim.Adam's single-tensor path step for step, rounding as ATen's CPU
// kernels round (lerp and addcmul fused, addcdiv as self + (value * t1) / t2), so that results equal
// torch's bit for bit in the common case. Every element is read once and written once: master, moments, and the
// compute-dtype copy of the parameter in the same pass.

template <typename G, typename O>
void adam_range(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out,
                int64_t begin, int64_t end, const AdamHyper& h) {
  const V grad_scale = set1(h.grad_scale), l2_decay = set1(h.l2_decay), decoupled = set1(h.decoupled_decay);
  const V one_minus_beta1 = set1(h.one_minus_beta1), beta2 = set1(h.beta2), one_minus_beta2 = set1(h.one_minus_beta2);
  const V bc2_sqrt = set1(h.bias_correction2_sqrt), eps = set1(h.eps), neg_step_size = set1(-h.step_size);
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    V g = mul(load(grad + i), grad_scale);
    V p = load(param + i);
    if (h.l2_decay != 0.0f) g = fmadd(p, l2_decay, g);              // Adam: grad.add(param, alpha=wd), fused
    if (h.decoupled_decay != 1.0f) p = mul(p, decoupled);           // AdamW: param * (1 - lr * wd)
    V m = load(exp_avg + i);
    m = fmadd(one_minus_beta1, sub(g, m), m);                         // lerp(m, g, 1 - beta1): fused, as in ATen
    V v = fmadd(mul(one_minus_beta2, g), g, mul(load(exp_avg_sq + i), beta2));     // mul_(beta2).addcmul_
    V denom = add(div(vsqrt(v), bc2_sqrt), eps);
    p = add(p, div(mul(neg_step_size, m), denom));                    // addcdiv_
    store(param + i, p);
    store(exp_avg + i, m);
    store(exp_avg_sq + i, v);
    store(out + i, p);
  }
  if (i < end) scalar::adam_range(param, grad, exp_avg, exp_avg_sq, out, i, end, h);
}
