"""Training on top of averaging: state and gradient averagers, progress tracking, the Optimizer."""

from .state_averager import TrainingStateAverager
from .training_averager import TrainingAverager
