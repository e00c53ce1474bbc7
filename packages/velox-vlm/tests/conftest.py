"""The tiny processor, shared by the tests (made once per session)."""

from __future__ import annotations

import pytest

from velox_vlm.testing import tiny_processor


@pytest.fixture(scope="session")
def processor():
    return tiny_processor()
