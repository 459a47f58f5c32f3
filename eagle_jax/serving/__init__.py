"""Continuous batching over the speculative engine: slots (device side) and the scheduler (host loop)."""

from eagle_jax.serving.scheduler import Handle, QueueFull, Request, Scheduler, SpecSchedule, schedule_for
from eagle_jax.serving.slots import SlotEngine, StepOutput

__all__ = ["Handle", "QueueFull", "Request", "Scheduler", "SlotEngine", "SpecSchedule", "StepOutput", "schedule_for"]
