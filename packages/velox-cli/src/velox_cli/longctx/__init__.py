"""The long-context suite: RULER-style tasks generated offline (:mod:`.tasks`), run with any
cache on any mlx-lm model and scored against the fp16 run (:mod:`.run`), reported as tables
and charts (:mod:`.report`); ``velox eval`` is its command."""
