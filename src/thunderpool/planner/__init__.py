"""Pure planning: model spec, cost model and placement over a cluster's nodes and links."""

from thunderpool.planner.cost import Prediction, Stage, predict
from thunderpool.planner.hardware import LinkSpec, NodeSpec
from thunderpool.planner.placement import PlacementError, Plan, explain, place
from thunderpool.planner.spec import ModelSpec, model_spec, model_spec_from_config

__all__ = [
    "LinkSpec",
    "ModelSpec",
    "NodeSpec",
    "PlacementError",
    "Plan",
    "Prediction",
    "Stage",
    "explain",
    "model_spec",
    "model_spec_from_config",
    "place",
    "predict",
]
