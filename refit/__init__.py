"""Weight transport for rlfleet: move the trainer's weights into every engine, fast and never half-way silently.

Placeholder docstring; see the contract below (filled in once the API settles).
"""

from refit.errors import ApplyError, ManifestError, RefitError, RefitUsageError, TransferError
from refit.outcome import Outcome, Participant, ParticipantResult, PhaseTimings, RefitReport, assign_ranks
from refit.ports import LocalSenderPort, ReceiverPort, SenderPort
from refit.sender import WeightSender
from refit.synchronizer import RefitConfig, WeightSynchronizer, retry_once

__all__ = [
    "ApplyError", "LocalSenderPort", "ManifestError", "Outcome", "Participant", "ParticipantResult", "PhaseTimings",
    "ReceiverPort", "RefitConfig", "RefitError", "RefitReport", "RefitUsageError", "SenderPort", "TransferError",
    "WeightSender", "WeightSynchronizer", "assign_ranks", "retry_once",
]
