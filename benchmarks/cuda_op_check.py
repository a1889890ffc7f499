"""Which CUDA paths this torch takes for the speed features that cannot be checked on a CPU:
the float32-output matmuls of the gradient-accumulation fusion and the fused optimizer's
device-side step skipping. Prints one line per check (run at the start of a device round)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, not an installed copy
    from megatrain.runtime.grad_accumulation_fusion import _CUDA_PATH, accumulate_wgrad_, wgrad_new

    g = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    exact = g.float().t() @ x.float()
    acc = torch.ones(256, 128, device="cuda")
    ptr = acc.data_ptr()
    accumulate_wgrad_(acc, g, x)
    err = ((acc - 1 - exact).abs().max() / exact.abs().max()).item()
    print(f"accumulate_wgrad_: path {_CUDA_PATH[0]}, in place {acc.data_ptr() == ptr}, relative error {err:.2e}")
    new = wgrad_new(g, x)
    err = ((new - exact).abs().max() / exact.abs().max()).item()
    print(f"wgrad_float32: path {_CUDA_PATH[0]}, dtype {new.dtype}, relative error {err:.2e}")
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    p.grad = torch.ones(4, device="cuda")
    opt = torch.optim.AdamW([p], fused=True)
    opt.found_inf = torch.ones((), device="cuda")
    opt.step()
    skipped = torch.equal(p.detach(), torch.ones(4, device="cuda")) and float(opt.state[p]["step"]) == 0.0
    opt.found_inf = torch.zeros((), device="cuda")
    opt.step()
    print(f"fused AdamW found_inf: skipped when set {skipped}, stepped when clear "
          f"{not torch.equal(p.detach(), torch.ones(4, device='cuda'))}")


if __name__ == "__main__":
    main()
