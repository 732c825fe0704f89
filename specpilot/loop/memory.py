"""What the loop remembers: every trial of every run, and which mechanisms worked on which deployment.

SQLite (stdlib) in WAL mode with autocommit: each write is committed the moment it is made, so a run killed at any
point loses only the trial it was in the middle of; `optimize(..., resume_run=id)` then replays the run and finds
every finished trial here instead of measuring it again.

Tables
  deployments  fingerprint -> target, drafter, drafter kind, family, device name, regime
  runs         id, deployment, started, status (running | finished | failed | interrupted), base config
  trials       one gated candidate: run, round, key (unique per run), mechanism, config, delta, figures, verdict,
               reason rejected, status, adopted (it became the run's best), created
  rounds       the diagnosis of each round (gap rows or the fixed ordering used) and a note
  yardsticks   per run: systems measured once next to round 0 on the dev prompts (our AR, the stock system),
               tokens/s and details, so that every round's best can be stated against them
  validated    per run and mechanism: the delta that was adopted and its gain (ok=1), or ok=0 when the mechanism
               was explored and nothing it proposed passed the gate

Transfer (`validated_for`): deployments are similar when they share the target family or the drafter kind (v1).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specpilot.loop.registry import Deployment

SCHEMA = """
CREATE TABLE IF NOT EXISTS deployments (fingerprint TEXT PRIMARY KEY, target TEXT, drafter TEXT, drafter_kind TEXT,
    family TEXT, device_name TEXT, regime TEXT, created REAL);
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, deployment TEXT, started REAL, status TEXT,
    base_config TEXT);
CREATE TABLE IF NOT EXISTS trials (id INTEGER PRIMARY KEY AUTOINCREMENT, run INTEGER, round INTEGER, key TEXT,
    mechanism TEXT, config TEXT, delta TEXT, figures TEXT, verdict TEXT, reason TEXT, status TEXT,
    adopted INTEGER DEFAULT 0, created REAL, UNIQUE(run, key));
CREATE TABLE IF NOT EXISTS rounds (run INTEGER, round INTEGER, gaps TEXT, note TEXT, PRIMARY KEY(run, round));
CREATE TABLE IF NOT EXISTS yardsticks (run INTEGER, name TEXT, tokens_per_s REAL, detail TEXT,
    PRIMARY KEY(run, name));
CREATE TABLE IF NOT EXISTS validated (id INTEGER PRIMARY KEY AUTOINCREMENT, run INTEGER, deployment TEXT,
    mechanism TEXT, delta TEXT, gain REAL, ok INTEGER, created REAL, UNIQUE(run, mechanism, delta));
"""


@dataclass(frozen=True)
class Trial:
    id: int
    run: int
    round: int
    key: str
    mechanism: str
    config: dict
    delta: dict
    figures: dict
    verdict: str  # "baseline" | "accepted" | "rejected"
    reason: str  # why it was rejected ("" when accepted)
    status: str
    adopted: bool

    @property
    def passed(self) -> bool:
        return self.verdict in ("baseline", "accepted")

    @property
    def median(self) -> float:
        return self.figures.get("dev", {}).get("median", 0.0)

    @property
    def gain(self) -> float:
        """Dev tokens/s over the reference measured next to it (1.0 for round 0, 0.0 when never measured)."""
        return self.figures.get("gain_dev", 0.0)

    @property
    def chain(self) -> float:
        """Dev speedup over round 0: the product of paired gains from round 0 to this trial (0.0: unmeasured)."""
        return self.figures.get("chain", 0.0)


@dataclass(frozen=True)
class Knowledge:
    """What similar deployments taught: mechanisms that worked (best gain first) and ones that only failed."""

    worked: list[tuple[str, dict, float]]  # (mechanism, delta adopted, gain as a ratio of tokens/s)
    failed: list[str]

    def describe(self) -> str:
        w = ", ".join(f"{m} {d} x{g:.2f}" for m, d, g in self.worked) or "nothing yet"
        return f"worked on similar deployments: {w}; failed there: {', '.join(self.failed) or 'nothing'}"


class Memory:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # explorer threads share one connection
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed write survives a process kill
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --- deployments and runs ---------------------------------------------------------------------------------

    def deployment(self, dep: Deployment) -> str:
        fp = dep.fingerprint()
        self._q("INSERT OR IGNORE INTO deployments VALUES (?,?,?,?,?,?,?,?)",
                (fp, dep.target, dep.drafter, dep.drafter_kind, dep.family, dep.device_name, dep.regime, time.time()))
        return fp

    def new_run(self, dep: Deployment) -> int:
        fp = self.deployment(dep)
        with self._lock:
            cur = self._db.execute("INSERT INTO runs (deployment, started, status, base_config) VALUES (?,?,?,?)",
                                   (fp, time.time(), "running", json.dumps(dep.config.to_dict())))
            return int(cur.lastrowid)

    def run_info(self, run: int) -> dict | None:
        rows = self._q("SELECT id, deployment, started, status, base_config FROM runs WHERE id=?", (run,))
        if not rows:
            return None
        i, d, s, st, base = rows[0]
        return {"id": i, "deployment": d, "started": s, "status": st, "base_config": json.loads(base)}

    def set_run_status(self, run: int, status: str) -> None:
        self._q("UPDATE runs SET status=? WHERE id=?", (status, run))

    # --- trials -------------------------------------------------------------------------------------------------

    _COLS = "id, run, round, key, mechanism, config, delta, figures, verdict, reason, status, adopted"

    @staticmethod
    def _trial(row) -> Trial:
        i, run, rnd, key, mech, cfg, delta, figs, verdict, reason, status, adopted = row
        return Trial(i, run, rnd, key, mech, json.loads(cfg), json.loads(delta), json.loads(figs), verdict,
                     reason or "", status, bool(adopted))

    def record_trial(self, run: int, round: int, key: str, mechanism: str, config: dict, delta: dict,
                     figures: dict, verdict: str, reason: str = "", status: str = "finished") -> Trial:
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO trials (run, round, key, mechanism, config, delta, figures, verdict, reason, status, "
                "created) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (run, round, key, mechanism, json.dumps(config), json.dumps(delta), json.dumps(figures), verdict,
                 reason, status, time.time()))
            row = self._db.execute(f"SELECT {self._COLS} FROM trials WHERE id=?", (cur.lastrowid,)).fetchone()
        return self._trial(row)

    def find_trial(self, run: int, key: str) -> Trial | None:
        rows = self._q(f"SELECT {self._COLS} FROM trials WHERE run=? AND key=? AND status='finished'", (run, key))
        return self._trial(rows[0]) if rows else None

    def finished_trials(self, run: int) -> list[Trial]:
        rows = self._q(f"SELECT {self._COLS} FROM trials WHERE run=? AND status='finished' ORDER BY id", (run,))
        return [self._trial(r) for r in rows]

    def adopt(self, trial_id: int) -> None:
        self._q("UPDATE trials SET adopted=1 WHERE id=?", (trial_id,))

    def best_trial(self, run: int) -> Trial | None:
        rows = self._q(f"SELECT {self._COLS} FROM trials WHERE run=? AND adopted=1 ORDER BY round DESC, id DESC "
                       "LIMIT 1", (run,))
        return self._trial(rows[0]) if rows else None

    def best_config(self, run: int) -> dict | None:
        t = self.best_trial(run)
        return t.config if t else None

    # --- rounds -------------------------------------------------------------------------------------------------

    def record_round(self, run: int, round: int, gaps: list, note: str = "") -> None:
        self._q("INSERT OR REPLACE INTO rounds VALUES (?,?,?,?)", (run, round, json.dumps(gaps), note))

    def rounds(self, run: int) -> list[dict]:
        rows = self._q("SELECT round, gaps, note FROM rounds WHERE run=? ORDER BY round", (run,))
        return [{"round": r, "gaps": json.loads(g), "note": n} for r, g, n in rows]

    # --- yardsticks ----------------------------------------------------------------------------------------------

    def record_yardstick(self, run: int, name: str, tokens_per_s: float, detail: dict | None = None) -> None:
        self._q("INSERT OR REPLACE INTO yardsticks VALUES (?,?,?,?)",
                (run, name, tokens_per_s, json.dumps(detail or {})))

    def yardsticks(self, run: int) -> dict[str, dict]:
        """name -> {"tokens_per_s", **detail} of the systems measured next to round 0."""
        rows = self._q("SELECT name, tokens_per_s, detail FROM yardsticks WHERE run=? ORDER BY name", (run,))
        return {n: {"tokens_per_s": t, **json.loads(d)} for n, t, d in rows}

    # --- what worked --------------------------------------------------------------------------------------------

    def validate(self, run: int, dep: Deployment, mechanism: str, delta: dict, gain: float, ok: bool = True) -> None:
        self._q("INSERT OR REPLACE INTO validated (run, deployment, mechanism, delta, gain, ok, created) "
                "VALUES (?,?,?,?,?,?,?)",
                (run, self.deployment(dep), mechanism, json.dumps(delta, sort_keys=True), gain, int(ok), time.time()))

    def validated_for(self, dep: Deployment, exclude_run: int | None = None) -> Knowledge:
        """Mechanisms that worked (best gain first, one entry each) / only failed on similar deployments."""
        rows = self._q(
            "SELECT v.mechanism, v.delta, v.gain, v.ok FROM validated v JOIN deployments d "
            "ON v.deployment = d.fingerprint WHERE (d.family = ? OR d.drafter_kind = ?) AND v.run != ? "
            "ORDER BY v.gain DESC, v.id", (dep.family, dep.drafter_kind, -1 if exclude_run is None else exclude_run))
        worked: dict[str, tuple[dict, float]] = {}
        failed: list[str] = []
        for mech, delta, gain, ok in rows:
            if ok and mech not in worked:
                worked[mech] = (json.loads(delta), gain)
            elif not ok and mech not in failed:
                failed.append(mech)
        return Knowledge([(m, d, g) for m, (d, g) in worked.items()], [m for m in failed if m not in worked])


def open(path: str | Path) -> Memory:  # noqa: A001  (memory.open(path), as the loop's API reads)
    return Memory(path)
