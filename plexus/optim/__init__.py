"""Training on top of averaging: state and gradient averagers, progress tracking, the Optimizer."""

from .diloco import DiLoCoOptimizer, RoundStats
from .diloco_options import DiLoCoOptions
from .grad_averager import GradientAverager, GradientAveragerFactory
from .grad_scaler import GradScaler
from .optimizer import Optimizer
from .power_sgd_averager import PowerSGDGradientAverager
from .progress_tracker import ProgressTracker
from .state_averager import TrainingStateAverager
from .training_averager import TrainingAverager

__all__ = [
    "DiLoCoOptimizer",
    "DiLoCoOptions",
    "GradScaler",
    "GradientAverager",
    "GradientAveragerFactory",
    "Optimizer",
    "PowerSGDGradientAverager",
    "ProgressTracker",
    "RoundStats",
    "TrainingAverager",
    "TrainingStateAverager",
]
