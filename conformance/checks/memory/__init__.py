"""memory: does the backend read or write only what the step gives it?

Three passes per case, each catching what the others cannot:

1. **NaN poison** (in the worker): every KV slot no request owns (block 0, free blocks, each
   request's slots past its length) holds NaN. A read whose value is then masked by a zero weight
   still turns the output NaN (0 × NaN = NaN), where numerics' finite poison would vanish; and
   after the step the pool must differ from before in exactly the step's own slots, so a write
   outside the slot mapping that stays inside the pool is seen.
2. **memcheck** (compute-sanitizer, a child process with PyTorch's caching allocator off, so each
   tensor is its own allocation): reads and writes outside any allocation, such as one element
   past the block table or one block past the end of the pool.
3. **initcheck** (compute-sanitizer): the pool is fresh memory where only the owned slots were
   written, so a read of any other slot is reported, however its value is used afterwards; and
   so is a read of any other never-written memory (a workspace). A copy (host API report) counts
   only when the backend copies memory the harness made (``sanitizer.Report.is_set_aside``); in
   the draft loop's replayed graphs copies are not checked (no frame says whose they are).

Errors the tool counted but did not print or this parser did not read fail the case.

What none of them sees: a read of *another request's written* slot whose value is masked out
(initialized, finite, inside the pool). Numerics sees it where the value is used.

Every layer kind runs them (an indexer's pool is its keys and their scales; its answer a choice
of positions, judged as the other checks judge it, so a NaN read shows as a NaN logit chosen or a
position left out). The passes run on a subset (decode, spec-verify, a small mixed batch, block
boundaries, for the first layout of each kind; DeepSeek's sparse layers' decode, verify, messy
index rows and fp8_ds_mla cache, the indexer's decode and verify, and a batch of token trees);
from a decode case also a draft loop of k = 4 under CUDA graphs (memcheck and initcheck) and a
few steps of the reference engine, async, drafting through the backend (memcheck: its pools are
zeroed). A case given with ``--case`` always runs. A case's children run side by side: each is
mostly compute-sanitizer's start-up and JIT compiles under it, CPU work.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends.base import AttentionBackend
from conformance.cases.grammar import Case, format_layer
from conformance.checks.base import EVERY_KIND, Check, Plan
from conformance.checks.engine import engine_skip_reason
from conformance.checks.memory import sanitizer
from conformance.harness.allocation_map import AllocationMap
from conformance.harness.evidence import EvidenceItem, without
from conformance.harness.graphs import cuda_graph_skip_reason
from conformance.harness.nan_poison import nan_poison_pass
from conformance.harness.step import prepare_case
from conformance.process_exit import describe_exit
from conformance.results import Outcome, Verdict

# The mixed case is the small one (43 query tokens): initcheck prints a report per 32 bytes of a
# copy it thinks never written, and each costs the child time (a copy of flash-attn-4's output:
# 256 a query token, 6,144 took 110 s on an H100), so with such a copy the suite's 282-token mixed
# case did not finish.
MEMORY_TAGS = ("decode", "spec-verify k=3", "mixed, small", "block boundaries decode", "block boundaries verify")
# Tags each naming one case of the suite (a sparse layout or the indexer's): run wherever they are.
# The messy rows hold -1 between entries and entries past each token's position: an index past
# the slots a request owns reads what the poison and initcheck see.
ONE_CASE_TAGS = (
    "sparse: decode past top-k",
    "sparse: spec-verify k=3 (MTP)",
    "messy index rows: decode and verify",
    "sparse, fp8_ds_mla: decode and MTP verify",
    "tree: with decodes, a prefill and a chain",
    "indexer: decode past top-k",
    "indexer: MTP verify",
)
DECODE_TAGS = ("decode", "sparse: decode past top-k", "indexer: decode past top-k", "")  # "": a --case
CHILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Stage:
    """How one sanitized stage runs (``conformance.checks.memory.sanitized_case`` runs it)."""

    tools: tuple[str, ...] = sanitizer.TOOLS
    # CUDA graph capture needs PyTorch's caching allocator (memcheck then sees only accesses
    # outside its segments), and a copy node in a replayed graph has no Python frame to say whose
    # it is (the harness's own input copies are there), so only kernels are checked in it.
    replays_graphs: bool = False


SANITIZED_STAGES = {
    "step": Stage(),
    "draft-loop": Stage(replays_graphs=True),
    "engine": Stage(tools=("memcheck",)),  # the engine's pools are zeroed: initcheck could not see an unowned read
}


class MemoryCheck(Check):
    name = "memory"
    kinds = EVERY_KIND
    drives_trees = True  # its step hands the case's trees to the backend and the oracle
    question = (
        "no access outside its allocations, no read of a KV slot no request owns, no write outside the slot mapping?"
    )

    @classmethod
    def describe_evidence(cls, evidence: dict[str, Any]) -> list[EvidenceItem]:
        items = []
        for finding in evidence.get("findings") or []:
            count = f" ×{finding['count']}" if finding.get("count", 1) > 1 else ""
            where = f"{finding.get('stage', '')}, {finding.get('phase') or 'no phase'}"
            text = finding.get("place", "")
            if finding.get("kernel"):
                text = f"{finding['kernel']} → {text}"
            items.append(EvidenceItem(f"{finding['tool']} ({where}): {finding['what']}{count}", text))
            if finding.get("launch"):
                items.append(EvidenceItem("launched from", "\n".join(finding["launch"]), block=True))
        return items + super().describe_evidence(without(evidence, "findings"))

    def skip_reason(self, backend_cls: type[AttentionBackend], device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device: compute-sanitizer checks GPU memory accesses"
        if sanitizer.find_tool() is None:
            return "compute-sanitizer not found (it ships with the CUDA toolkit: put its bin/ on PATH or set CUDA_HOME)"
        return None

    def case_skip_reason(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> str | None:
        reason = super().case_skip_reason(backend_cls, case, device)
        if not reason and case.tag and case.tag not in MEMORY_TAGS + ONE_CASE_TAGS:  # a --case always runs
            return f"memory runs a subset: {', '.join(MEMORY_TAGS + ONE_CASE_TAGS)}"
        return reason

    def plan(self, backend_cls: type[AttentionBackend], cases: list[Case], device: torch.device) -> Plan:
        """The subset: the suite's cases tagged ``MEMORY_TAGS`` of the first layout of each kind,
        and those tagged ``ONE_CASE_TAGS`` (a case given with --case always runs)."""
        plan: Plan = {}
        first_layout: dict[str, str] = {}  # kind -> the layout the subset runs on
        for case in cases:
            reason = self.case_skip_reason(backend_cls, case, device)
            if not reason and case.tag in MEMORY_TAGS:
                layer = format_layer(case.spec, case.layer_options)
                first = first_layout.setdefault(case.spec.kind, layer)
                if first != layer:
                    reason = f"memory runs a subset: the first {case.spec.kind} layout ({first})"
            plan[case.id] = reason
        return plan

    def details(self) -> dict[str, Any]:
        return {
            "passes": ["nan-poison", *sanitizer.TOOLS],
            "subset": list(MEMORY_TAGS + ONE_CASE_TAGS),
            "draft_loop_steps": 4,
            "engine_stage_tools": list(SANITIZED_STAGES["engine"].tools),
            "sanitizer": sanitizer.find_tool(),
        }

    def run_case(self, backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> Outcome:
        backend_file = Path(inspect.getfile(backend_cls)).name
        stages = self.stages(backend_cls, case, device)
        children = [(stage, tool) for stage in stages for tool in SANITIZED_STAGES[stage].tools]
        with ThreadPoolExecutor(max_workers=min(len(children) + 1, os.cpu_count() or 1)) as pool:
            poisoned = pool.submit(run_poison_pass, backend_cls, case)
            pending = [pool.submit(timed_child, backend_cls, case, stage, tool) for stage, tool in children]
            findings, metrics = poisoned.result()
            runs = [child.result() for child in pending]
        unsupported = None
        for stage in stages:
            for tool in SANITIZED_STAGES[stage].tools:
                run, where, seconds = runs[children.index((stage, tool))]
                metrics[f"{tool} {stage} seconds"] = seconds
                metrics[f"{tool} {stage} errors"] = run.error_count
                if run.unsupported:
                    unsupported = run.unsupported
                    break
                kept, set_aside = sanitizer.partition(run.reports, where, tool, backend_file)
                found = sanitizer.grouped(kept, where, tool, stage)
                if set_aside:
                    metrics[f"{tool} {stage} set aside"] = len(set_aside)
                    # What they were, so that a reader can tell a failing API call from a copy.
                    kinds = Counter(re.sub(r"0x[0-9a-f]+|\d+", "N", report.what)[:160] for report in set_aside)
                    metrics[f"{tool} {stage} set aside kinds"] = dict(kinds.most_common(3))
                # Counted but not read back (past the print limit, or not understood): never a pass.
                unread = (run.error_count or 0) - len(run.reports)
                if not found and unread > 0:
                    found = [
                        {
                            "tool": tool,
                            "stage": stage,
                            "phase": "",
                            "what": f"{unread} errors not read back",
                            "place": "the tool's report (past its print limit, or not understood here):\n"
                            + run.output_tail,
                        }
                    ]
                if not found and run.returncode != 0:
                    raise RuntimeError(
                        f"the sanitized child ({tool}, {stage}) exited with status {run.returncode} "
                        f"and no report:\n{run.output_tail}"
                    )
                findings += found
            if unsupported:
                break
        if findings:
            first = findings[0]
            more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
            kernel = f" in {first['kernel'][:80]}" if first.get("kernel") else ""
            reason = (
                f"{first['tool']}, {first['stage']}, {first['phase']}: "
                f"{first['what']}{kernel} at {first['place']}{more}"
            )
            return Outcome(Verdict.FAIL, reason, metrics=metrics, evidence={"findings": findings})
        if unsupported:
            return Outcome(
                Verdict.SKIP,
                f"NaN-poison pass clean; compute-sanitizer cannot check this device: {unsupported}",
                metrics=metrics,
            )
        return Outcome(
            Verdict.PASS,
            "clean under NaN poison, memcheck and initcheck ("
            + ", ".join(self.stages(backend_cls, case, device))
            + ")",
            metrics=metrics,
        )

    @staticmethod
    def stages(backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> list[str]:
        """The step always; from the decode case, the draft loop (k = 4, CUDA graphs) and the engine."""
        stages = ["step"]
        if case.tag in DECODE_TAGS and all(query == 1 for _, query in case.batch):
            if cuda_graph_skip_reason(backend_cls, device) is None:
                stages.append("draft-loop")
            if engine_skip_reason(backend_cls, case, device) is None:
                stages.append("engine")
        return stages


def poison_pass(backend_cls: type[AttentionBackend], case: Case, device: torch.device) -> tuple[list[dict], dict]:
    """One step over a NaN-poisoned pool (``nan_poison``): (findings, metrics)."""
    return nan_poison_pass(prepare_case(backend_cls, case, device, poison=False))


def run_child(
    backend_cls: type[AttentionBackend], case: Case, stage: str, tool: str | None
) -> tuple[sanitizer.SanitizerRun, AllocationMap]:
    """One child (``conformance.checks.memory.sanitized_case``) under ``tool``, and the map of what it
    allocated. An eager stage under a tool runs with PyTorch's caching allocator off: each tensor
    is then its own allocation, and memcheck sees a read one element past any of them."""
    replays_graphs = stage in SANITIZED_STAGES and SANITIZED_STAGES[stage].replays_graphs
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    if tool is not None and not replays_graphs:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    backend = f"{backend_cls.__module__}:{backend_cls.__qualname__}"
    tool_path = (sanitizer.find_tool() or "compute-sanitizer") if tool else None
    with tempfile.TemporaryDirectory(prefix="conformance-memory-") as workdir:
        out_path = Path(workdir, "out.json")
        run = sanitizer.run(
            tool_path,
            tool or stage,
            [backend, case.id, stage, str(out_path)],
            env,
            CHILD_TIMEOUT_S,
            api_copies=not replays_graphs,
        )
        run.written = json.loads(out_path.read_text()) if out_path.exists() else None
        where = AllocationMap.load(out_path) if out_path.exists() and tool else AllocationMap()
    return run, where


def timed_child(
    backend_cls: type[AttentionBackend], case: Case, stage: str, tool: str
) -> tuple[sanitizer.SanitizerRun, AllocationMap, float]:
    """``run_child``, and its wall time in seconds (with the case's other children beside it)."""
    started = time.perf_counter()
    run, where = run_child(backend_cls, case, stage, tool)
    return run, where, round(time.perf_counter() - started, 1)


def run_poison_pass(backend_cls: type[AttentionBackend], case: Case) -> tuple[list[dict], dict]:
    """``poison_pass`` in a child process: a backend's wild access there ends the child, not the worker."""

    run, _ = run_child(backend_cls, case, "nan-poison", None)
    if run.returncode == 0 and run.written is not None:
        return run.written["findings"], run.written["metrics"]
    return [
        {
            "tool": "nan-poison",
            "stage": "step",
            "phase": "",
            "what": f"the step's process {describe_exit(run.returncode)}",
            "place": "its output:\n" + run.output_tail,
        }
    ], {}
