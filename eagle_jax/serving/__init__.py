"""Continuous batching over the speculative engine: slots (device side) and the scheduler (host loop)."""

from eagle_jax.serving.scheduler import Handle, QueueFull, Request, Scheduler, SpecSchedule
from eagle_jax.serving.slots import SlotEngine, StepOutput

__all__ = ["Handle", "QueueFull", "Request", "Scheduler", "SlotEngine", "SpecSchedule", "StepOutput"]
