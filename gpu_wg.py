"""_weight_grad configs at N=32 x 256 tokens, r=16: dA (full=X) and dB+dS (full=dY) per Llama-8B width."""
import itertools, time, torch, triton
import lightning_multilora.kernels.triton_lora as TL
import lightning_multilora.kernels.triton_kernels as K
from lightning_multilora.kernels import LoRAWeights
dev = torch.device("cuda")
N, T, R = 32, 256, 16
torch.manual_seed(0)
configs = [(bk, bt, w, 3) for bk, bt, w in itertools.product((64, 128, 256), (32, 64, 128), (4, 8))
           if bk * bt <= 256 * 64] + [(128, 64, 4, 2), (128, 64, 4, 4), (256, 64, 8, 2), (256, 64, 8, 4), (128, 128, 8, 2)]
def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50)
for d_in, d_out in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)):
    a = tuple(torch.randn(R, d_in, device=dev) * 0.01 for _ in range(N))
    b = tuple(torch.randn(d_out, R, device=dev) * 0.01 for _ in range(N))
    w = LoRAWeights(a, b, (2.0,) * N, (0.0,) * N, tuple(i * T for i in range(N)), tuple((i + 1) * T for i in range(N)))
    table = TL.pointer_table(w, dev)
    sched = TL.schedule(w.starts, w.ends, N * T, dev)
    copies = TL.weight_copies(w, table, torch.bfloat16, dev)
    targets = TL._fresh_grads(w, table, dev)
    low = torch.randn(N * T, table.width, device=dev)
    ds = torch.zeros(N * T, table.width, device=dev)
    for g_is_a, k in ((True, d_in), (False, d_out)):
        full = torch.randn(N * T, k, device=dev, dtype=torch.bfloat16)
        ptrs = targets.a_ptrs if g_is_a else targets.b_ptrs
        with_ds = not g_is_a
        wargs = (copies.b_ptrs, copies.witness, ds) if with_ds else (ptrs, targets.a[0], low)
        nbytes = full.numel() * 2 + N * R * k * 4 * 2 + (N * T * R * 4 * (k // 128) if with_ds else 0)
        res = []
        for bk, bt, nw, st in configs:
            for split in (TL._split_for(N * table.r_chunks * triton.cdiv(k, 128), T, dev),):
                args = (low, full, ptrs, targets.a[0], sched.seg_start, sched.seg_end, table.ranks, table.scaling,
                        table.drop_p, table.ranks, *wargs, k, table.r_chunks, split, low.stride(0), full.stride(0),
                        ds.stride(0))
                grid = (N * table.r_chunks, triton.cdiv(k, bk), split)
                fn = lambda: K._weight_grad.fn[grid](*args, G_IS_A=g_is_a, HAS_DROPOUT=False, ATOMIC=split > 1,
                    DOT_PRECISION="tf32", G_ALIGNED=True, WITH_DS=with_ds, W_ALIGNED=True, BLOCK_T=bt, BLOCK_K=bk,
                    BLOCK_R=table.block_r, num_warps=nw, num_stages=st)
                try:
                    fn(); torch.cuda.synchronize()
                    ms = bench(fn)
                except Exception as e:
                    continue
                res.append((ms, bk, bt, nw, st, split))
        res.sort()
        cur = [r for r in res if (r[1], r[2], r[3], r[4]) in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3), (256, 32, 8, 3))]
        print(f"{d_in}->{d_out} {'dA' if g_is_a else 'dB+dS'} K={k}: best {res[0][0]*1e3:.1f} us {res[0][1:]} "
              f"{nbytes/res[0][0]/1e9:.0f} GB/s; current-best {cur[0][0]*1e3:.1f} us {cur[0][1:]}; top3 {[(round(r[0]*1e3,1),)+r[1:] for r in res[:3]]}", flush=True)
