"""What ``velox generate`` says beside its ratio of fp16's held bytes to the cache's: after a
short generation most of a velox cache's tokens may still wait in fp16 (its sinks, its window
and the flush quantum), and a cache's fitted and policy state may outweigh its few tokens."""

from __future__ import annotations

__all__ = ["fp16_wait_note", "ratio_notes"]


def ratio_notes(caches: list, held: int, fp16: int) -> list[str]:
    """What explains ``velox generate``'s ratio (``fp16 / held``) after a short generation:
    the tokens that wait in fp16 (:func:`fp16_wait_note`) and, below 1x, the fitted and
    policy state the velox caches hold beside their tokens."""
    from velox_core import VeloxCache

    out = [n for n in [fp16_wait_note(caches)] if n]
    if held > fp16:
        state = 0
        for c in caches:
            if isinstance(c, VeloxCache):
                state += sum(x.state_nbytes for t in c.tiers for x in (t.key_codec, t.value_codec))
                state += 0 if c.policy is None else c.policy.nbytes
        if state:
            out.append(
                f"below 1x: besides its tokens the cache holds {state / 2**20:.2f} MiB of "
                "fitted codec and retention-policy state, which a longer context amortizes"
            )
    return out


def fp16_wait_note(caches: list) -> str:
    """Why a short generation's ratio reads low: how many of the tokens the first velox
    cache holds wait as given (fp16) before they are coded, and what keeps them so (its sinks,
    its window and the flush quantum). "" for caches that code nothing (fp16, mlx-lm's, an
    eviction that keeps its tokens as given) or whose heads hold different tokens."""
    import math

    from velox_core import Identity, VeloxCache

    c = next((c for c in caches if isinstance(c, VeloxCache)), None)
    if c is None or getattr(c, "ragged", False):
        return ""
    t = c.tiers[0]
    if isinstance(t.key_codec, Identity) and isinstance(t.value_codec, Identity):
        return ""
    segments = c.segments()
    held = sum(s.tokens for s in segments)
    given = sum(
        s.tokens
        for s in segments
        if isinstance(s.key_codec, Identity) and isinstance(s.value_codec, Identity)
    )
    if not given:
        return ""
    quantum = math.lcm(c.flush, t.key_codec.block, t.value_codec.block)
    wait = (
        f"up to {quantum - 1} more past the window wait until {quantum} are coded at once "
        f"(flush={c.flush}"
        + (f", rounded up to the codecs' {quantum}-token blocks" if quantum != c.flush else "")
        + ")"
        if quantum > 1
        else "every token past the window is coded on arrival (flush=1)"
    )
    return (
        f"{given} of the {held} tokens each layer holds wait in fp16, kept as given before "
        f"they are coded: the first sinks={c.sinks}, the newest window={c.window}, and {wait}; "
        "the ratio rises toward the codes' own as more tokens are coded"
    )
