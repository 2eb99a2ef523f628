"""popxl_flash: FlashAttention for Graphcore IPUs, written as PopXL graph code.

Public names only; see ``docs/`` for the user guide.
"""
from popxl_flash import reference
from popxl_flash.autodiff import autodiff, called_graphs_grad_info
from popxl_flash.backend import BACKEND, popxl
from popxl_flash.backward import FlashAttentionGrad
from popxl_flash import costmodel
from popxl_flash import context_parallel
from popxl_flash.context_parallel import (context_parallel_attention,
                                          context_parallel_attention_grad)
from popxl_flash.config import AttentionConfig, explain
from popxl_flash.flash_attn_interface import flash_attn_func, flash_attn_func_grad
from popxl_flash.forward import FlashAttention
from popxl_flash import kvcache
from popxl_flash.kvcache import flash_attn_with_kvcache
from popxl_flash.fpchecks import enable_floating_point_checks
from popxl_flash.graphs import reachable_graphs
from popxl_flash.functional import (flash_attention, flash_attention_grad,
                                    flash_attention_qkv_packed, flash_attention_qkv_packed_grad)
from popxl_flash.schedule import BlockSchedule, plan
from popxl_flash.varlen import flash_attn_varlen_func

__all__ = [
    "BACKEND", "popxl", "reference", "AttentionConfig", "BlockSchedule", "plan", "explain",
    "costmodel",
    "FlashAttention", "FlashAttentionGrad", "flash_attention", "flash_attention_qkv_packed",
    "flash_attention_grad", "flash_attention_qkv_packed_grad", "flash_attn_func",
    "flash_attn_func_grad",
    "enable_floating_point_checks", "autodiff", "called_graphs_grad_info",
    "flash_attn_varlen_func", "flash_attn_with_kvcache", "kvcache", "reachable_graphs",
    "context_parallel", "context_parallel_attention", "context_parallel_attention_grad",
]
__version__ = "0.1.0"
