"""velox-qfilters: Q-Filters, KV eviction by a context-agnostic projection of the keys
(arXiv 2503.02812)."""

from velox_core.artifacts import fingerprint, identity
from velox_core.cache.eviction import eviction_method

from .artifact import (
    Filters,
    MissingFiltersError,
    find_filters,
    load_filters,
    resolve_filters,
    save_filters,
    search_dirs,
)
from .cache import QFiltersCache
from .config import QFiltersConfig
from .fit import fit_filters, principal_filters
from .policy import QFiltersPolicy

__all__ = [
    "METHOD",
    "Filters",
    "MissingFiltersError",
    "QFiltersCache",
    "QFiltersConfig",
    "QFiltersPolicy",
    "find_filters",
    "fingerprint",
    "fit_filters",
    "identity",
    "load_filters",
    "principal_filters",
    "resolve_filters",
    "save_filters",
    "search_dirs",
]

METHOD = eviction_method(
    QFiltersCache,
    summary="evict keys with the smallest projection on a per-head query direction fitted once",
    paper="https://arxiv.org/abs/2503.02812",
)
