"""An engine and the contexts made from it are freed when the caller lets go of them, without the
cyclic garbage collector: the build makes engines to time (builder/pdl.py, aux_streams.py, the
eager check) one after another, and each holds weights and CUDA graph pools."""
from __future__ import annotations

import gc
import weakref

import sartor


def test_an_engine_with_run_contexts_is_freed_by_reference_counting(tiny_plan, images):
    engine = sartor.load(tiny_plan, device="cpu")
    contexts = [engine.context(), engine.context(aux_streams=1)]
    for context in contexts:
        context.run({"images": images})
    assert len(engine._contexts) == 2
    gone = weakref.ref(engine)
    gc.disable()
    try:
        del engine, contexts, context
        assert gone() is None
    finally:
        gc.enable()
