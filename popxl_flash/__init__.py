"""popxl_flash: FlashAttention for Graphcore IPUs, written as PopXL graph code.

Public names only; see ``docs/`` for the user guide. The package's layers, each importing only
the ones below it:

* the entry points: this module, ``api/`` (the functional API, flash-attn's names, varlen, the
  KV cache, context parallelism, autodiff, ``pf.explain``), ``addons`` (popxl-addons layers),
  ``selfcheck`` and ``demo`` (commands);
* ``checks/``: the self-check, copy check, tolerance rule, float64 reference, naive baseline,
  harness and devices;
* ``graph/``: PopXL graph code (block helpers, segments, score modifiers, the forward and
  backward modules);
* ``plan/``: host-side planning, numpy only (options and validation, the block schedule, loop
  steps, cost model and chunk choice, the KV-cache and context-parallel plans);
* ``backend``: the PopXL module in use; ``emulator/``: a CPU emulator of PopXL that knows
  nothing of attention.
"""
from popxl_flash.backend import BACKEND, popxl
from popxl_flash.plan import costmodel
from popxl_flash.plan.config import AttentionConfig
from popxl_flash.plan.schedule import BlockSchedule, plan
from popxl_flash.graph.backward import FlashAttentionGrad
from popxl_flash.graph.forward import FlashAttention
from popxl_flash.graph.reachable import reachable_graphs
from popxl_flash.api import context_parallel, kvcache
from popxl_flash.api.autodiff import autodiff, called_graphs_grad_info
from popxl_flash.api.context_parallel import (context_parallel_attention,
                                              context_parallel_attention_grad)
from popxl_flash.api.explain import explain
from popxl_flash.api.flash_attn_interface import flash_attn_func, flash_attn_func_grad
from popxl_flash.api.fpchecks import enable_floating_point_checks
from popxl_flash.api.functional import (flash_attention, flash_attention_grad,
                                        flash_attention_qkv_packed,
                                        flash_attention_qkv_packed_grad)
from popxl_flash.api.kvcache import flash_attn_with_kvcache
from popxl_flash.api.packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                    flash_attn_varlen_kvpacked_func,
                                    flash_attn_varlen_qkvpacked_func)
from popxl_flash.api.rotary import apply_rotary, rotary_tables
from popxl_flash.api.varlen import flash_attn_varlen_func
from popxl_flash.checks import reference

__all__ = [
    "BACKEND", "popxl", "reference", "AttentionConfig", "BlockSchedule", "plan", "explain",
    "costmodel",
    "FlashAttention", "FlashAttentionGrad", "flash_attention", "flash_attention_qkv_packed",
    "flash_attention_grad", "flash_attention_qkv_packed_grad", "flash_attn_func",
    "flash_attn_func_grad",
    "enable_floating_point_checks", "autodiff", "called_graphs_grad_info",
    "flash_attn_varlen_func", "flash_attn_with_kvcache", "kvcache", "reachable_graphs",
    "context_parallel", "context_parallel_attention", "context_parallel_attention_grad",
    "apply_rotary", "rotary_tables", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
]
__version__ = "0.1.0"
