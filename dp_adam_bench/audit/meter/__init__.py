"""A mechanism meter: white-box measurements, from one run, of the quantities the accountant assumed, each tested
against its claimed value with a stated power.

An epsilon audit (:mod:`~dp_adam_bench.audit.whitebox`) asks whether the canaries *look* more private than claimed;
it only sees bugs large enough to move a lower bound past the claim. The meter instead measures the mechanism the
accountant reasons about, directly: it runs the config (its variant, noise mechanism, sigma, clip, delta, sampler
and schedule, through the real trainer and privatizer) on a task whose per-example gradients it knows, records every
released quantity of every step, predicts each release's mean with its own clipping, whitens by the mechanism's
strategy C, and tests what it measured against what the privatizer and the accountant claim.

The parts, in the order a run goes through them:

* task.py — :class:`MeterTask`, the vector task's canaries (their norms ``NORMS``, the shared coordinate
  ``SHARED``, ``TRIALS`` independent trials); model_task.py — :class:`ModelMeterTask`, the same canaries as a model
  for the real clipping engines;
* recording.py — the recording backends (:class:`MeterBackend`, :class:`ModelRecorder`): every release and the
  parameters before it, a control's broken privatizer or engine in the trainer's place;
* prediction.py — each release's predicted mean, x_t = (1/B) sum_{i in batch_t} clip(s_t g_i; C);
* checks/ — the statistical checks, one file named for each check a verdict names (``sampling``,
  ``sensitivity``, ``noise_std``, ``correlation``, ``noise_covariance``, ``multiplier``), each with its test and its
  power; checks/row.py runs every check of a row, each at level ``ALPHA`` / (number of checks) (a union bound: a
  correct mechanism fails any check of a row with probability <= ALPHA), the power against a 10 % error
  (``EFFECT``) computed from the run's own standard errors (tests/test_meter.py plants such errors many times and
  checks the detection rate);
* replay.py — ``post_processing``, the exact check: the registered variant replayed on the releases alone
  reproduces the run's parameters;
* result.py — :class:`MeterCheck` and :class:`MeterResult`, what a row reports;
* runners.py — :func:`meter_config` (the vector task), :func:`meter_model` (a model task through a clipping engine)
  and :func:`audit_model` (the white-box audit through that model task);
* the fine-tuning methods (full, head, top<k>, LoRA, prefix, RGP): finetune_task.py — :class:`FinetuneMeterTask`
  (a model every method accepts, through ``trainer.prepare``); oracle.py — per-example gradients by autograd on
  each example alone at the state the run's engine saw; checks/clipped_sum.py — the engine's clipped sum against
  the oracle's, every step; replay.py's ``replay_method`` — every tensor of the model replayed from the releases on a
  twin built on other private data; finetune_runners.py — :func:`meter_finetune` and :func:`audit_finetune`.
"""

from dp_adam_bench.audit.meter.checks.clipped_sum import clipped_sum_check
from dp_adam_bench.audit.meter.checks.correlation import LAGS
from dp_adam_bench.audit.meter.checks.multiplier import multiplier_check
from dp_adam_bench.audit.meter.checks.noise_covariance import joint_noise_check
from dp_adam_bench.audit.meter.checks.release import release_checks, release_stats
from dp_adam_bench.audit.meter.checks.sampling import rate_check, sampling_check, sampling_reference
from dp_adam_bench.audit.meter.checks.stats import ALPHA, EFFECT, ReleaseStats, critical, power_at
from dp_adam_bench.audit.meter.finetune_runners import METHODS, audit_finetune, meter_finetune
from dp_adam_bench.audit.meter.finetune_task import FinetuneMeterTask
from dp_adam_bench.audit.meter.model_task import MODEL_NORM, ModelMeterTask
from dp_adam_bench.audit.meter.recording import (
    WATCH_EVERY,
    FinetuneRecorder,
    MeterBackend,
    ModelRecorder,
    StepRecord,
    recorder,
    watched,
)
from dp_adam_bench.audit.meter.replay import REPLAY_TOL
from dp_adam_bench.audit.meter.result import MeterCheck, MeterResult
from dp_adam_bench.audit.meter.runners import audit_model, meter_config, meter_model
from dp_adam_bench.audit.meter.task import (
    NORM_CLASSES,
    NORMS,
    NULL_COORDS,
    SHARED,
    TRIALS,
    MeterTask,
    class_members,
    example_norms,
)

#: the name tests/test_meter.py imports (meter.py's private name before the meter became a package)
_sampling_check = sampling_check

__all__ = [
    "ALPHA",
    "EFFECT",
    "LAGS",
    "METHODS",
    "MODEL_NORM",
    "NORM_CLASSES",
    "NORMS",
    "NULL_COORDS",
    "REPLAY_TOL",
    "SHARED",
    "TRIALS",
    "WATCH_EVERY",
    "FinetuneMeterTask",
    "FinetuneRecorder",
    "MeterBackend",
    "MeterCheck",
    "MeterResult",
    "MeterTask",
    "ModelMeterTask",
    "ModelRecorder",
    "ReleaseStats",
    "StepRecord",
    "audit_finetune",
    "audit_model",
    "class_members",
    "clipped_sum_check",
    "critical",
    "example_norms",
    "joint_noise_check",
    "meter_config",
    "meter_finetune",
    "meter_model",
    "multiplier_check",
    "power_at",
    "rate_check",
    "recorder",
    "release_checks",
    "release_stats",
    "sampling_check",
    "sampling_reference",
    "watched",
]
