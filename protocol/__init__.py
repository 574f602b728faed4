"""LEAFE wire protocol: events, task assignments, samples, subjects, stream specs, codec, prompt
format.

Pure data (msgspec + stdlib). Everything that crosses a process boundary is defined here.
"""

from leafe.protocol.codec import (
    CODEC_HEADER,
    CODEC_VERSION,
    MSG_ID_HEADER,
    ProtocolError,
    decode_event,
    decode_sample,
    decode_task,
    decode_weights,
    encode,
    headers_for,
    message_id,
)
from leafe.protocol.events import (
    ROOT_BRANCH,
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
    WeightsPublished,
    event_id_for,
)
from leafe.protocol.prompt import (
    PROMPT_FORMAT,
    ChatTokenizer,
    HistoryEntry,
    prompt_sha256,
    render_messages,
)
from leafe.protocol.samples import ChatMessage, Sample
from leafe.protocol.subjects import (
    STREAMS,
    InvalidRunId,
    StreamSpec,
    dead_letter_subject,
    event_subject,
    sample_subject,
    task_subject,
    validate_run_id,
    weights_subject,
)
from leafe.protocol.tasks import TaskAssignment, episode_id_for, episode_owner

__all__ = [
    "CODEC_HEADER",
    "CODEC_VERSION",
    "MSG_ID_HEADER",
    "PROMPT_FORMAT",
    "ROOT_BRANCH",
    "STREAMS",
    "Branch",
    "ChatMessage",
    "ChatTokenizer",
    "EpisodeEvent",
    "EpisodeFinished",
    "EpisodeStarted",
    "HistoryEntry",
    "InvalidRunId",
    "Outcome",
    "ProtocolError",
    "Reflection",
    "Rollback",
    "Sample",
    "Step",
    "StreamSpec",
    "TaskAssignment",
    "WeightsPublished",
    "dead_letter_subject",
    "decode_event",
    "decode_sample",
    "decode_task",
    "decode_weights",
    "encode",
    "episode_id_for",
    "episode_owner",
    "event_id_for",
    "event_subject",
    "headers_for",
    "message_id",
    "prompt_sha256",
    "render_messages",
    "sample_subject",
    "task_subject",
    "validate_run_id",
    "weights_subject",
]
