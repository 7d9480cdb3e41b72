"""Eviction layer: online session signals, what a serving system knows about a finished request.

`SessionStats` learns, from arrivals and finishes alone (no training pass, no future), the
probability that a request's session continues, per class of what is known when the request
frees its blocks: its turn index in the session, its prompt length and its output length. It
also keeps the distribution of gaps between a turn's finish and the next turn's arrival. Every
update is O(1); the session table is bounded (least recently seen sessions are forgotten).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from pagedkv.errors import InvariantViolation

MAX_TRACKED_SESSIONS = 1 << 16
"""Sessions remembered at once; the least recently seen is forgotten beyond this."""
NUM_TURN_CLASSES = 4  # turn 0, 1, 2, 3 and later
NUM_LENGTH_CLASSES = 8  # prompt tokens: < 512, < 1k, < 2k, ... < 32k, longer
NUM_OUTPUT_CLASSES = 4  # generated tokens: < 64, < 256, < 1024, longer
NUM_CLASSES = NUM_TURN_CLASSES * NUM_LENGTH_CLASSES * NUM_OUTPUT_CLASSES
NUM_PROMPT_CLASSES = NUM_TURN_CLASSES * NUM_LENGTH_CLASSES  # the class without the output
MIN_CLASS_SAMPLES = 16
"""A class with fewer finished turns falls back to its (turn, prompt length) class, and that
to its turn class."""
PRIOR_PROBABILITY = 0.5
PRIOR_WEIGHT = 2.0
NUM_GAP_BINS = 48
"""Gap histogram bins: bin i holds gaps in [2**((i-1)/2), 2**(i/2)) seconds (bin 0: < 1 s)."""


class SessionRequest(Protocol):
    """What the signals read of a request (pagedkv's `Request` has all of it)."""

    request_id: str
    session_id: str | None
    num_prompt_tokens: int
    num_tokens: int


def _length_class(num_tokens: int, first: int, factor: int, num_classes: int) -> int:
    """0 .. num_classes - 1: below `first` tokens, then by factors of `factor`."""
    bound = first
    for klass in range(num_classes - 1):
        if num_tokens < bound:
            return klass
        bound *= factor
    return num_classes - 1


_GAP_EDGES = [2.0 ** (index / 2) for index in range(NUM_GAP_BINS - 1)]


def gap_bin(gap_s: float) -> int:
    """The histogram bin of a gap in seconds (see `NUM_GAP_BINS`)."""
    return bisect_right(_GAP_EDGES, gap_s)


class SessionStats:
    """Online continuation probabilities and the inter-turn gap distribution.

    A request whose `session_id` is None is a session of its own (turn 0, never continued).
    A turn counts as *continued* once a later request of its session arrives; the latest turns
    have had less time to be continued, a bias that shrinks every class alike.

    Invariants: `num_continued[c] <= num_finished[c]` for every class; the session table
    holds at most `MAX_TRACKED_SESSIONS` entries; `num_gaps == sum(gap_counts)`.
    """

    def __init__(self, clock: Callable[[], float], max_sessions: int = MAX_TRACKED_SESSIONS):
        self.clock = clock
        self.max_sessions = max_sessions
        self.num_finished = [0] * NUM_CLASSES
        self.num_continued = [0] * NUM_CLASSES
        self.num_prompt_finished = [0] * NUM_PROMPT_CLASSES
        self.num_prompt_continued = [0] * NUM_PROMPT_CLASSES
        self.num_turn_finished = [0] * NUM_TURN_CLASSES
        self.num_turn_continued = [0] * NUM_TURN_CLASSES
        self.gap_counts = [0] * NUM_GAP_BINS
        self.num_gaps = 0
        # session id -> [turns arrived, class of the last finished turn or -1, its finish time]
        self._sessions: OrderedDict[str, list] = OrderedDict()
        self._turn_of: dict[str, int] = {}  # request id -> its turn index, while it runs

    def note_arrival(self, request: SessionRequest) -> int:
        """A request arrived (once per request); count its session's last turn as continued.

        Returns:
            The request's turn index in its session (0 for a first turn or no session).
        """
        request_id = request.request_id
        turn = self._turn_of.get(request_id)
        if turn is not None:
            return turn  # seen before (a preempted request coming back)
        session_id = request.session_id
        if session_id is None:
            self._turn_of[request_id] = 0
            return 0
        sessions = self._sessions
        entry = sessions.get(session_id)
        if entry is None:
            entry = sessions[session_id] = [0, -1, 0.0]
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
        else:
            sessions.move_to_end(session_id)
            klass = entry[1]
            if klass >= 0:
                self.num_continued[klass] += 1
                self.num_prompt_continued[klass // NUM_OUTPUT_CLASSES] += 1
                self.num_turn_continued[klass // (NUM_LENGTH_CLASSES * NUM_OUTPUT_CLASSES)] += 1
                gap_s = self.clock() - entry[2]
                self.gap_counts[gap_bin(gap_s if gap_s > 0.0 else 0.0)] += 1
                self.num_gaps += 1
                entry[1] = -1
        turn = entry[0]
        entry[0] = turn + 1
        self._turn_of[request_id] = turn
        return turn

    def class_of(self, request: SessionRequest) -> int:
        """The class of what is known about a finished request."""
        turn = self._turn_of.get(request.request_id, 0)
        if turn >= NUM_TURN_CLASSES:
            turn = NUM_TURN_CLASSES - 1
        num_prompt = request.num_prompt_tokens
        length = _length_class(num_prompt, 512, 2, NUM_LENGTH_CLASSES)
        output = _length_class(request.num_tokens - num_prompt, 64, 4, NUM_OUTPUT_CLASSES)
        return (turn * NUM_LENGTH_CLASSES + length) * NUM_OUTPUT_CLASSES + output

    def note_finished(self, request: SessionRequest) -> float:
        """The request finished: record its class; return its continuation probability."""
        klass = self.class_of(request)
        probability = self.probability(klass)
        self._turn_of.pop(request.request_id, None)
        self.num_finished[klass] += 1
        self.num_prompt_finished[klass // NUM_OUTPUT_CLASSES] += 1
        self.num_turn_finished[klass // (NUM_LENGTH_CLASSES * NUM_OUTPUT_CLASSES)] += 1
        session_id = request.session_id
        if session_id is not None:
            entry = self._sessions.get(session_id)
            if entry is not None:
                entry[1] = klass
                entry[2] = self.clock()
        return probability

    def probability(self, klass: int) -> float:
        """P(continued | class), smoothed; a sparse class backs off (`MIN_CLASS_SAMPLES`)."""
        num_finished = self.num_finished[klass]
        if num_finished >= MIN_CLASS_SAMPLES:
            return (self.num_continued[klass] + PRIOR_PROBABILITY * PRIOR_WEIGHT) / (
                num_finished + PRIOR_WEIGHT
            )
        prompt = klass // NUM_OUTPUT_CLASSES
        num_finished = self.num_prompt_finished[prompt]
        if num_finished >= MIN_CLASS_SAMPLES:
            return (self.num_prompt_continued[prompt] + PRIOR_PROBABILITY * PRIOR_WEIGHT) / (
                num_finished + PRIOR_WEIGHT
            )
        turn = klass // (NUM_LENGTH_CLASSES * NUM_OUTPUT_CLASSES)
        return (self.num_turn_continued[turn] + PRIOR_PROBABILITY * PRIOR_WEIGHT) / (
            self.num_turn_finished[turn] + PRIOR_WEIGHT
        )

    def forget_request(self, request_id: str) -> None:
        """Drop a request that arrived but never finished (aborted while waiting)."""
        self._turn_of.pop(request_id, None)

    def check_invariants(self) -> None:
        for klass in range(NUM_CLASSES):
            if not 0 <= self.num_continued[klass] <= self.num_finished[klass]:
                raise InvariantViolation(
                    f"sessions: class {klass} continued {self.num_continued[klass]} of "
                    f"{self.num_finished[klass]}"
                )
        if len(self._sessions) > self.max_sessions:
            raise InvariantViolation("sessions: more tracked sessions than the bound")
        if sum(self.gap_counts) != self.num_gaps:
            raise InvariantViolation("sessions: gap histogram does not add up")
