"""Final-answer grading, shared by the training reward (`opd_patches.task.reward`) and evaluation.

`grade(response, gold)` extracts the final answer of a model response and compares it with the gold
answer:

1. Extraction (in this process, plain string scanning): the part after the last `</think>` when there
   is one, then its LAST complete `\\boxed{...}` / `\\fbox{...}` (balanced braces, `\\{ \\}` skipped;
   also `\\boxed 5`), else the last `Answer: X` line that DAPO-Math-17k prompts ask for, else no answer.
   A response still inside an unfinished thought has no final answer and scores 0 (`no_answer`,
   `GradeResult.unfinished_thought`). R1-Distill's chat template ends the generation prompt with an
   open `<think>` (its responses hold `</think>` but no `<think>`), so whether a thought is open
   depends on the prompt: `unfinished_thought(response, prompt_opened)` is true when the generation
   prompt opened one (`prompt_opens_thought(prompt)`; `opd_patches.task.prompt.opens_thought(tokenizer)`
   derives it once from a chat template) or the response opened one itself, and no `</think>`
   followed. Why 0 and not the last `\\boxed{}` of the draft: R1 writes its answer after `</think>`;
   what it boxes while thinking is a candidate it may still reject, and a response cut at the token
   cap mid-thought has committed to nothing (crediting its drafts would reward rambling into the cap
   and hide truncation). Templates without thoughts (ChatML) and responses that open none are graded
   on their whole text, as before.
2. A string fast path: equal after removing spacing, `$`, `\\left`/`\\right` and `\\dfrac`/`\\tfrac`
   means correct (it never decides "wrong").
3. math-verify (`verify(parse(gold), parse(answer))`, gold first as its docs ask), run in a worker
   PROCESS. math-verify's own timeouts use SIGALRM, which only works in the main thread, while VERL
   calls reward functions from executor threads of Ray actors; so they are switched off
   (`parsing_timeout=None`, `timeout_seconds=None`) and a worker still busy after `timeout_s` is
   killed (the call returns `decided_by="timeout"`) and started again on the next call.

`GradeResult.decided_by` says which step decided: `string_match`, `math_verify` and `no_answer` are
verdicts of the rule grader (`GradeResult.decided`); `parse_error` (math-verify could not parse the
answer or the gold), `timeout` and `error` are not: they count as wrong for the training reward, and
evaluation may ask a model verifier about them (`opd_patches.eval.verifier`, off by default).

The worker is `python -c` loading this file by path: it imports only math-verify, not `opd_patches`
(whose import pulls in VERL and torch). It caps its own address space and, per request, its CPU time,
so a worker orphaned in a runaway sympy computation (its parent killed mid-call) still ends.
`OPD_GRADER_WORKERS` (default 1) sets how many workers one process keeps; a call waits for a free
one before its timeout starts.

This module imports only the standard library at top level: the worker executes it too.
"""

from __future__ import annotations

import json
import os
import queue
import re
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 10.0
_STARTUP_TIMEOUT_S = 120.0  # a fresh worker imports sympy; generous for a loaded host
_WORKER_MEMORY_BYTES = 4 << 30  # address-space cap of a worker: a runaway bignum fails with MemoryError
_WORKER_CPU_GRACE_S = 30  # a worker ends itself after this much CPU time beyond the request's timeout


@dataclass(frozen=True)
class GradeResult:
    correct: bool
    extracted: str | None  # the final answer found in the response, None when there is none
    decided_by: str  # "string_match" | "math_verify" | "no_answer" | "parse_error" | "timeout" | "error"
    reason: str
    unfinished_thought: bool = False  # the response ended inside a thought (then decided_by is no_answer)

    @property
    def decided(self) -> bool:
        """Whether the rule grader reached a verdict; False for parse_error, timeout and error, the
        cases an optional model verifier (`opd_patches.eval.verifier`) may be asked about."""
        return self.decided_by in RULE_VERDICTS


RULE_VERDICTS = ("string_match", "math_verify", "no_answer")


# --- extraction -------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_RE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")  # DAPO's pattern (verl math_dapo); last match wins
_BARE_BOX_ARG_RE = re.compile(r"[ \t]+([^\s$]+)")  # `\boxed 5`
_THINK_START, _THINK_END = "<think>", "</think>"


def _boxed_argument(text: str, start: int) -> tuple[str, int] | None:
    """(argument, end) of a `\\boxed` whose name ends at `start`; None if unbalanced (cut off)."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            c = text[j]
            if c in "{}" and text[j - 1] == "\\":
                continue  # \{ and \} are set braces, not grouping
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j], j + 1
        return None
    m = _BARE_BOX_ARG_RE.match(text, start)
    return (m.group(1), m.end()) if m else None


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOX_RE.finditer(text))):
        found = _boxed_argument(text, m.end())
        if found is not None:
            return found[0]
    return None


def _unwrap(answer: str) -> str:
    """Strip math delimiters, bold markers, a trailing period and boxes around the whole answer."""
    while True:
        s = answer.strip().strip("*").strip()
        for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s = s[len(left) : -len(right)].strip()
        s = s.rstrip(".").strip()
        m = _BOX_RE.match(s)
        found = _boxed_argument(s, m.end()) if m else None
        if found is not None and found[1] == len(s):
            s = found[0]
        if s == answer:
            return s
        answer = s


def prompt_opens_thought(prompt: str) -> bool:
    """Whether a rendered generation prompt leaves a thought open (its last think tag is `<think>`)."""
    return prompt.rfind(_THINK_START) > prompt.rfind(_THINK_END)


def unfinished_thought(response: str, prompt_opened: bool = False) -> bool:
    """Whether `response` ends inside a thought: its last think tag is `<think>`, or it has none and the
    generation prompt opened one."""
    start, end = response.rfind(_THINK_START), response.rfind(_THINK_END)
    return start > end or (start == end == -1 and prompt_opened)


def extract_answer(response: str, prompt_opened: bool = False) -> tuple[str | None, str]:
    """(answer, where it came from: "boxed" | "answer_line" | "none" | "unfinished_thought")."""
    if unfinished_thought(response, prompt_opened):
        return None, "unfinished_thought"
    if _THINK_END in response:
        response = response.rsplit(_THINK_END, 1)[1]
    boxed = _last_boxed(response)
    if boxed is not None:
        answer = _unwrap(boxed)
        return (answer or None), "boxed"
    lines = _ANSWER_RE.findall(response)
    if lines:
        answer = _unwrap(lines[-1])
        return (answer or None), "answer_line"
    return None, "none"


# --- fast path ------------------------------------------------------------------------------------

_SPACING_RE = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[,!;: ]|\s+|\$")


def _normalize(s: str) -> str:
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return _SPACING_RE.sub("", s).rstrip(".")


# --- worker process -------------------------------------------------------------------------------

_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_opd_grader_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._serve()\n"
)


def _math_verify(gold: str, answer: str) -> dict:
    """Runs in the worker: the math-verify verdict for one pair."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Both are bare answers: boxing them makes math-verify read the whole string as one expression.
    gold_parsed = parse("\\boxed{" + gold + "}", (LatexExtractionConfig(),), parsing_timeout=None)
    answer_parsed = parse(
        "\\boxed{" + answer + "}", (LatexExtractionConfig(), ExprExtractionConfig()), parsing_timeout=None
    )
    correct = bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=None))
    return {"correct": correct, "gold_parsed": bool(gold_parsed), "answer_parsed": bool(answer_parsed)}


def _serve() -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per line on the original stdout."""
    import logging
    import resource

    out = os.dup(1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, not into the protocol
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # e.g. "Timeout is disabled" warnings
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass
    _math_verify("1", "1")  # import and warm up before saying ready

    def send(obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(out, data) :]

    send({"ready": True})
    cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    for line in sys.stdin.buffer:
        request = json.loads(line)
        used = time.process_time()
        soft = int(used + min(request["timeout_s"], 1e6) + _WORKER_CPU_GRACE_S) + 1
        if cpu_hard == resource.RLIM_INFINITY or soft < cpu_hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))  # SIGXCPU ends a runaway orphan
        try:
            send(_math_verify(request["gold"], request["answer"]))
        except Exception as exc:  # noqa: BLE001  (MemoryError, RecursionError, sympy bugs)
            send({"error": f"{type(exc).__name__}: {exc}"[:500]})


class _Worker:
    """One worker process with a line-based JSON protocol over its stdin/stdout pipes."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._buf = b""
        self._selector = selectors.DefaultSelector()  # not select(): fds above 1024 in big processes
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            self._read(time.monotonic() + _STARTUP_TIMEOUT_S)
        except (TimeoutError, EOFError) as exc:
            self.kill()
            raise RuntimeError(
                f"the math-verify grader worker did not start ({exc}); is math-verify installed for "
                f"{sys.executable}? (its stderr is above)"
            ) from exc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, gold: str, answer: str, timeout_s: float) -> dict:
        data = (json.dumps({"gold": gold, "answer": answer, "timeout_s": timeout_s}) + "\n").encode()
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data) :]
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> dict:
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not self._selector.select(min(remaining, 60.0)):  # bounded: timeout_s may be inf
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise EOFError(f"worker exited with code {self.proc.wait()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._selector.close()
        self.proc.stdin.close()
        self.proc.stdout.close()


class _Pool:
    def __init__(self, size: int):
        self._free: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._free.put(None)  # started on first use

    def verify(self, gold: str, answer: str, timeout_s: float) -> dict:
        worker = self._free.get()
        try:
            if worker is not None and not worker.alive():
                worker.kill()
                worker = None
            if worker is None:
                worker = _Worker()  # its start-up is not part of the request's timeout
            try:
                return worker.request(gold, answer, timeout_s)
            except TimeoutError:
                worker.kill()
                worker = None
                return {"timeout": True}
            except (EOFError, OSError) as exc:
                worker.kill()
                worker = None
                return {"error": f"worker died: {exc}"}
        finally:
            self._free.put(worker)

    def close(self) -> None:
        """Stop the idle workers (a busy one is left to its call); later calls start new ones."""
        idle = []
        while True:
            try:
                idle.append(self._free.get_nowait())
            except queue.Empty:
                break
        for worker in idle:
            if worker is not None:
                worker.kill()
            self._free.put(None)


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(max(1, int(os.environ.get("OPD_GRADER_WORKERS", "1"))))
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # the parent's workers are not ours to use


os.register_at_fork(after_in_child=_forget_pool_after_fork)


# --- grading --------------------------------------------------------------------------------------


def grade(response: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S, fast_path: bool = True,
          prompt_opened_thought: bool = False) -> GradeResult:
    """Grade one model response against a gold answer; never raises on model output, never hangs.

    `timeout_s` bounds the math-verify comparison (not the start of a worker); `fast_path=False` sends
    even string-equal answers to math-verify (tests use it to check that math-verify accepts a gold).
    `prompt_opened_thought`: the generation prompt ended inside a thought (R1's template; see above).
    """
    gold = _unwrap(str(gold))
    answer, source = extract_answer(response, prompt_opened_thought)
    if source == "unfinished_thought":
        return GradeResult(False, None, "no_answer", "inside an unfinished thought (no </think> after the last "
                           "<think>, the prompt's included): no final answer", unfinished_thought=True)
    if answer is None:
        where = "after </think>" if _THINK_END in response else "in the response"
        return GradeResult(False, None, "no_answer", f"no \\boxed{{}} and no 'Answer:' line {where}")
    if fast_path and _normalize(answer) == _normalize(gold):
        return GradeResult(True, answer, "string_match", f"{source} answer equals the gold after normalisation")
    verdict = _get_pool().verify(gold, answer, timeout_s)
    if verdict.get("timeout"):
        return GradeResult(False, answer, "timeout", f"math-verify took longer than {timeout_s:g} s")
    if "error" in verdict:
        return GradeResult(False, answer, "error", verdict["error"])
    if verdict["correct"]:
        return GradeResult(True, answer, "math_verify", f"{source} answer is equivalent to the gold")
    unparsed = [name for name in ("gold", "answer") if not verdict[f"{name}_parsed"]]
    if unparsed:
        return GradeResult(False, answer, "parse_error", f"math-verify could not parse the {' or '.join(unparsed)}")
    return GradeResult(False, answer, "math_verify", f"{source} answer is not equivalent to the gold")
