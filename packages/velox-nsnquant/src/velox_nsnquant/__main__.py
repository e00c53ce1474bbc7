"""``python -m velox_nsnquant [--write]``: fit the universal codebooks (see
:mod:`velox_nsnquant.codebook`)."""

from .codebook import main

raise SystemExit(main())
