"""PLAN: cost models, solvers, and the Plan every runtime decision comes from."""

from tiered.planner.make import make_plan
from tiered.planner.plan import LayerPlan, Plan

__all__ = ["LayerPlan", "Plan", "make_plan"]
