"""Compile the fused kernels (compress, decompress-and-sum, the parameter gather's
decode-and-apply) for an NVIDIA target without a GPU (Triton builds PTX and a cubin from
the source alone): the check that they compile for real, which the CPU interpreter
cannot give (it accepts code the compiler refuses).

``python -m loco_megatron.loco.triton_kernels.ahead`` (TRITON_INTERPRET unset) compiles the
configurations of :data:`CONFIGS` for sm_90 and prints one line per configuration:
``name ok ptx_bytes cubin_bytes mul.rn``. Exit code 1 when any fails.
"""

from __future__ import annotations

import os
import sys

# name -> (kernel, constexprs); the runtime arguments' types follow the kernels' signatures.
CONFIGS = {
    "compress 4-bit original": ("compress", dict(BITS=4, HAS_ERR=True, UNIFORM=False, MSE=False, ROTATE=False,
                                                 STOCHASTIC=False)),
    "compress 4-bit original, whole-block rows": ("compress", dict(BITS=4, HAS_ERR=True, UNIFORM=False, MSE=False,
                                                                   ROTATE=False, STOCHASTIC=False, EVEN=True)),
    "compress 2-bit default (uniform+mse+hadamard, EF)": ("compress", dict(BITS=2, HAS_ERR=True, UNIFORM=True,
                                                                           MSE=True, ROTATE=True,
                                                                           STOCHASTIC=False)),
    "compress 2-bit default + stochastic": ("compress", dict(BITS=2, HAS_ERR=True, UNIFORM=True, MSE=True,
                                                             ROTATE=True, STOCHASTIC=True)),
    "decompress 4-bit fp32": ("decompress", dict(BITS=4, ROTATE=False, OUT_BF16=False)),
    "decompress 2-bit hadamard bf16": ("decompress", dict(BITS=2, ROTATE=True, OUT_BF16=True)),
    "param apply 4-bit fp32 in place": ("apply", dict(BITS=4, ROTATE=False, DTYPE=0, OWN=False, HAS_DST2=False,
                                                      SWAP=False)),
    "param apply 2-bit hadamard bf16 own shard": ("apply", dict(BITS=2, ROTATE=True, DTYPE=1, OWN=True,
                                                                HAS_DST2=True, SWAP=False)),
}

_COMPRESS_ARGS = {"g_ptr": "*fp32", "err_ptr": "*i8", "err_s_ptr": "*fp32", "codes_ptr": "*u8",
                  "scales_ptr": "*fp32", "new_err_ptr": "*i8", "new_err_s_ptr": "*fp32", "stats_ptr": "*fp32",
                  "signs_ptr": "*fp32", "numel": "i32", "num_blocks": "i32", "row_numel": "i32",
                  "row_blocks": "i32", "beta": "fp32", "alpha": "fp32", "rot_scale": "fp32", "key": "i32"}
_DECOMPRESS_ARGS = {"recv_ptr": "*u8", "recv_f32_ptr": "*fp32", "out_ptr": "*fp32", "signs_ptr": "*fp32",
                    "shard": "i32", "shard_blocks": "i32", "row_bytes": "i32", "code_bytes": "i32",
                    "scale": "fp32", "rot_scale": "fp32"}
_APPLY_ARGS = {"codes_ptr": "*u8", "scales_ptr": "*fp32", "src_ptr": "*fp32", "dst_ptr": "*fp32", "new_ptr": "*fp32",
               "dst2_ptr": "*fp32", "norms_ptr": "*fp32", "signs_ptr": "*fp32", "numel": "i32", "num_blocks": "i32",
               "rot_scale": "fp32"}
_PARAM_PTRS = ("src_ptr", "dst_ptr", "new_ptr", "dst2_ptr")
_SIZES = ("numel", "num_blocks", "row_numel", "shard", "shard_blocks")


def compile_one(kind: str, consts: dict, arch: int = 90):
    """The compiled kernel (``.asm`` holds ``ptx`` and ``cubin``) of one configuration,
    block 256, 4 rows (8 tiles per compress program), NO_FMA on."""
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    from loco_megatron.loco.triton_kernels import kernels  # noqa: PLC0415

    consts = dict(consts, B=256, LOG_B=8, ROWS=4, NO_FMA=True)
    if kind == "compress":
        fn, sig = kernels._compress_kernel, dict(_COMPRESS_ARGS)
        consts = {"TILES": 8, "EVEN": False, **consts}
    elif kind == "apply":  # the parameters' pointers at their dtype (bf16 as its uint16 bits)
        fn, sig = kernels._param_apply_kernel, dict(_APPLY_ARGS)
        sig.update({k: ("*fp32", "*u16", "*fp16")[consts["DTYPE"]] for k in _PARAM_PTRS})
    else:
        fn, sig = kernels._decompress_sum_kernel, dict(_DECOMPRESS_ARGS)
        consts["WORLD"] = 2
        if consts["OUT_BF16"]:
            sig["out_ptr"] = "*u16"
    # As the JIT specializes a launch: pointers (torch allocations) 16-byte aligned, and the
    # sizes divisible by 16 (the common case), so the PTX is the one a GPU runs.
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*") or k in _SIZES}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    failed = 0
    for name, (kind, consts) in CONFIGS.items():
        try:
            asm = compile_one(kind, consts).asm
            print(f"{name}: ok ptx {len(asm['ptx'])} cubin {len(asm['cubin'])} "
                  f"v4-loads {asm['ptx'].count('ld.global.v4')} mul.rn {'mul.rn.f32' in asm['ptx']}", flush=True)
        except Exception as e:  # report every configuration, then fail
            failed += 1
            while e.__cause__ is not None:  # the innermost error says what the compiler refused
                e = e.__cause__
            print(f"{name}: FAILED {' '.join(str(e).split())[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
