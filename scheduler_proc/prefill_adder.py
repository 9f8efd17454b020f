"""The budgets of one step's prompt admission, and the admission policies that spend them.

PrefillAdder holds three budgets (as SGLang's does):
- total: KV slots that may still be taken, after reserving for every running request an estimate
  of its remaining output (`new_token_ratio` x remaining max_new_tokens, clipped per request);
- input: prompt tokens this step may compute (`--max-prefill-tokens`);
- chunk: prompt tokens of one request per step (`--chunked-prefill-size`; None = no chunking, a
  prompt then goes whole, alone if it is larger than the input budget).
A request cut into a chunk ends the step's admissions: it resumes first next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from scheduler_proc.registry import Registry

if TYPE_CHECKING:
    from scheduler_proc.req import Req


@dataclass(slots=True)
class PrefillAdder:
    rem_total: int
    rem_input: int
    chunk_size: int | None
    pool_free: int  # slots free right now (the total budget without the reservation)
    nothing_running: bool  # a request alone may use the whole pool
    rows: int = 0
    chunked: bool = False

    def fits(self, pending: int, reserve: int) -> int:
        """Prompt tokens a request with `pending` uncomputed tokens may compute now (0: none)."""
        if self.chunked or self.rem_input <= 0:
            return 0
        if self.chunk_size is None:
            if pending > self.rem_input and self.rows > 0:
                return 0
            n = pending
        else:
            n = min(pending, self.rem_input, self.chunk_size)
        if pending + reserve <= self.rem_total and n <= self.pool_free:
            return n
        # Nothing else holds KV: run it on what the pool has (retraction can't help anyway).
        if self.nothing_running and self.rows == 0 and n <= self.pool_free:
            return n
        return 0

    def add(self, n: int, pending: int, reserve: int) -> None:
        self.rows += 1
        self.rem_input -= n
        self.rem_total -= pending + reserve
        self.pool_free -= n
        if n < pending:
            self.chunked = True

    def add_resumed_chunk(self, n: int, pending: int) -> None:
        """The next chunk of a running request's prompt: its KV is already in the reservation
        for running requests, so only the step's budgets shrink."""
        self.rows += 1
        self.rem_input -= n
        self.pool_free -= n
        if n == pending:  # the reservation held pending - 1: the chunk that ends a prompt takes one more
            self.rem_total -= 1
        if n < pending:
            self.chunked = True


# ---- admission policies (`--prefill-admission-policy`) --------------------------------------

Admit = Callable[["Req", int], bool]  # (request, tokens to compute this step) -> admitted
Reserve = Callable[["Req"], int]  # expected output tokens of a request
Pending = Callable[["Req"], int]  # tokens a request would compute if admitted now (less its cached prefix)


class AdmissionPolicy:
    name = ""

    def __init__(self, lookahead: int, force_fifo_every: int):
        self.lookahead = lookahead
        self.force_fifo_every = force_fifo_every

    def admit(self, waiting: deque["Req"], adder: PrefillAdder, reserve: Reserve, admit: Admit,
              can_admit: Callable[[], bool], pending: Pending) -> None:
        raise NotImplementedError

    @staticmethod
    def admit_in_order(waiting, adder, reserve, admit, can_admit, pending) -> None:
        """FIFO: admit from the head while it fits; the first that does not ends the step."""
        while waiting and can_admit():
            req = waiting[0]
            n = adder.fits(pending(req), reserve(req))
            if n == 0 or not admit(req, n):
                return


ADMISSION_POLICIES = Registry("admission policy")  # --prefill-admission-policy


@ADMISSION_POLICIES.register("fifo")
class FifoAdmission(AdmissionPolicy):
    def admit(self, waiting, adder, reserve, admit, can_admit, pending):
        self.admit_in_order(waiting, adder, reserve, admit, can_admit, pending)


@ADMISSION_POLICIES.register("pack")
class PackAdmission(AdmissionPolicy):
    """Look ahead `lookahead` waiting requests and fill the step's budget greedily with the
    cheapest whole prompts that fit, admitting the chosen ones in queue order, so a long head no
    longer blocks short requests behind it. Every `force_fifo_every` admissions that passed the
    head over, the head goes first in FIFO order, so it never starves; when nothing in the window
    fits, the head goes FIFO too (alone or chunked, if it exceeds the whole budget)."""

    def __init__(self, lookahead: int, force_fifo_every: int):
        super().__init__(lookahead, force_fifo_every)
        self.passed_over_head = 0  # admissions since the head was last taken

    def admit(self, waiting, adder, reserve, admit, can_admit, pending):
        if not waiting or adder.chunked:  # a chunk already ends this step's admissions
            return
        if self.force_fifo_every and self.passed_over_head >= self.force_fifo_every:
            head = waiting[0]
            self.admit_in_order(waiting, adder, reserve, admit, can_admit, pending)
            if head not in waiting:
                self.passed_over_head = 0
            return
        window = [waiting[i] for i in range(min(self.lookahead, len(waiting)))]
        order = {id(r): i for i, r in enumerate(window)}
        trial = replace(adder, chunk_size=None)  # whole prompts only
        chosen = []
        for req in sorted(window, key=lambda r: (pending(r), order[id(r)])):
            n = trial.fits(pending(req), reserve(req))
            if n == pending(req) and (adder.chunk_size is None or n <= adder.chunk_size):
                trial.add(n, pending(req), reserve(req))
                chosen.append(req)
        if not chosen:
            self.admit_in_order(waiting, adder, reserve, admit, can_admit, pending)
            self.passed_over_head = 0
            return
        head = waiting[0]
        for req in sorted(chosen, key=lambda r: order[id(r)]):
            if not can_admit():
                break
            n = adder.fits(pending(req), reserve(req))
            if n == 0 or not admit(req, n):
                break
            if req is head:
                self.passed_over_head = 0
            else:
                self.passed_over_head += 1
