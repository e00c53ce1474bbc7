"""velox's test aids: the conformance suite, tiny models, and the helpers and checks the
tests of velox-core and the method packages share.

The CPU kernel emulator (:mod:`velox_testing.emulate`, :mod:`velox_testing.emulate_io`) is
imported on use, not by this module.
"""

from .artifacts import (
    assert_artifact_refusals,
    assert_found_by_fingerprint,
    fitted_artifact,
    isolated_artifacts,
    loaded_without_artifact,
    shown_artifact,
)
from .baselines import attention_errors_vs_mlx_quant, fill_chunks
from .conformance import CacheConformance
from .eviction import EvictingConformance, FullBudgetConformance, Routed
from .kernel_env import kernel_env
from .kernel_path import (
    assert_cpu_declines,
    assert_kernel_partial,
    assert_step_like_reference,
    compile_cuda,
    compile_metal,
    emulated_gpu_fixture,
    needs_gxx,
    needs_nvcc,
    sign_words,
)
from .kv import (
    assert_attends_without_decoding,
    assert_exact_ends,
    assert_partials_close,
    assert_partials_equivalent,
    assert_reloads_alike,
    assert_rows_decode_alone,
    coded_segment,
    coded_segments,
    decode_logits,
    feed,
    greedy_agreement,
    kv_caches_after,
    kv_data,
    kv_like,
    random_prompt,
    rel_error,
)
from .linked import assert_batch_generate_refused, assert_linked_copies
from .models import FAMILIES, conformance_model, recommended_specs, tiny_model, tiny_tokenizer
from .refusals import (
    assert_head_dim_refused,
    assert_spec_refused,
    assert_tampered_state_refused,
)
from .scratch import scratch_dir

__all__ = [
    "FAMILIES",
    "CacheConformance",
    "EvictingConformance",
    "FullBudgetConformance",
    "Routed",
    "assert_artifact_refusals",
    "assert_attends_without_decoding",
    "assert_batch_generate_refused",
    "assert_cpu_declines",
    "assert_exact_ends",
    "assert_found_by_fingerprint",
    "assert_head_dim_refused",
    "assert_kernel_partial",
    "assert_linked_copies",
    "assert_partials_close",
    "assert_partials_equivalent",
    "assert_reloads_alike",
    "assert_rows_decode_alone",
    "assert_spec_refused",
    "assert_step_like_reference",
    "assert_tampered_state_refused",
    "attention_errors_vs_mlx_quant",
    "coded_segment",
    "coded_segments",
    "compile_cuda",
    "compile_metal",
    "conformance_model",
    "decode_logits",
    "emulated_gpu_fixture",
    "feed",
    "fill_chunks",
    "fitted_artifact",
    "greedy_agreement",
    "isolated_artifacts",
    "kernel_env",
    "kv_caches_after",
    "kv_data",
    "kv_like",
    "loaded_without_artifact",
    "needs_gxx",
    "needs_nvcc",
    "random_prompt",
    "recommended_specs",
    "rel_error",
    "scratch_dir",
    "shown_artifact",
    "sign_words",
    "tiny_model",
    "tiny_tokenizer",
]
