"""Inference engine: request scheduling, batched decoding, sampling and stop handling.

Import the submodules directly (e.g. ``from cedlm.engine.sampler import Sampler``); this package
deliberately imports nothing so that each module loads on its own.
"""
