"""The env stage: versions first: python, torch, the device, transformers (and whether the carried wheels replaced
it), the optional packages."""

from __future__ import annotations

import os
import platform

import torch

from .bootstrap import BOOT, _installed, _release
from .common import Budget, Context, StageResult


def stage_env(ctx: Context, budget: Budget) -> StageResult:
    """Versions first: torch, the device, transformers (and whether carried wheels replaced it)."""
    import transformers

    import eagle_hf
    from eagle_hf.hf.version import SUPPORTED_TRANSFORMERS, check_transformers_version

    res = StageResult()
    d = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "device": str(ctx.device),
        "transformers": transformers.__version__, "transformers_file": transformers.__file__,
        "eagle_hf_file": eagle_hf.__file__, "cpu_count": os.cpu_count(),
        "supported_transformers": f">={SUPPORTED_TRANSFORMERS[0]},<{SUPPORTED_TRANSFORMERS[1]}",
    }
    for name in ("accelerate", "safetensors", "huggingface_hub", "tokenizers", "packaging", "pytest", "pytest-timeout",
                 "scipy", "numpy", "triton", "bitsandbytes", "flash_attn", "flash-attn", "kernels"):
        d[f"pkg {name}"] = _installed(name)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        d.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                 memory_gib=round(props.total_memory / 2**30, 1), sdp_flash=torch.backends.cuda.flash_sdp_enabled(),
                 sdp_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                 sdp_cudnn=getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: None)(),
                 allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32, allow_tf32_cudnn=torch.backends.cudnn.allow_tf32)
    res["data"] = {"versions": d, "carried wheels": BOOT or {"action": "not run as a script"}}
    if BOOT.get("unpacked"):
        res.find(f"transformers {BOOT['installed_transformers']} is below {BOOT['floor']}: using the carried "
                 f"{transformers.__version__} ({len(BOOT['unpacked'])} wheels unpacked: {', '.join(BOOT['unpacked'])})")
    for unmet in BOOT.get("unmet", []):
        res.find(f"a requirement of the carried wheels is not met: {unmet}")
    if _release(torch.__version__) < (2, 6):
        res["status"] = "failed"
        res.find(f"torch {torch.__version__}: transformers 5.24 disables PyTorch below 2.6 (no model can be built)")
    try:
        check_transformers_version()
    except Exception as err:  # noqa: BLE001 - recorded
        res["status"] = "failed"
        res.find(f"eagle_hf refuses this transformers: {err}")
    res["summary"] = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), {d.get('device_name', ctx.device)}, "
                      f"transformers {transformers.__version__}")
    return res
