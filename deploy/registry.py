"""The MLflow Model Registry: this module writes to it (deploy/registry_read.py reads; the two
are the only modules that talk to it).

    register(run)        a new model version whose source is the run's adapter artifact,
                         tagged with run, base model, spec version, data window; alias `candidate`
    record_decision      the gate's decision and every number, on the version and in the store
    promote(version)     `champion` -> version, the old champion -> `previous`; refuses without a
                         recorded passing decision unless forced with a reason, and refuses a
                         version an operator rolled back (forced: allowed); the same version
                         twice is a no-op. `against`: the champion the decision was made
                         against -- a cycle promotes only if that is still the champion
    rollback([to])       `champion` back to `previous` (or a named version); `previous` then
                         goes one promotion further back, so a second rollback goes to the
                         version before that, never back to the one rolled back
    stage(version, share) `canary` -> version, serving `share` of requests (deploy/rollout.py);
                         needs a passing decision like promote; unstage() clears it,
                         withdraw_canary(version) only if it is that version; promoting the
                         canary's version clears it too
    repair()             finishes what a crash left: pending audit rows are checked against the
                         registry (done or not_applied), unpublished model-update events are sent
                         -- only the newest move of each alias: an older one's event is stale

Order of one move: audit row "pending" -> `previous` alias -> `champion` alias -> audit "done"
-> model-update event -> published. If the registry is unreachable mid-way, `champion` has not
moved (it is the last alias written), so serving never sees half a promotion, and `previous`
is put back, so the rollback target survives a failed promotion.

A model-update event is a wake-up, not an order: it carries the move's sequence number (`seq`,
the audit row's id), and followers (deploy/serving/follow.py) read what to serve from the registry.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from deploy.gate import Decision
from deploy.registry_read import (  # noqa: F401 - the registry's names, importable from here
    CANARY,
    CANDIDATE,
    CHAMPION,
    PREVIOUS,
    MlflowException,
    RegistryError,
    RegistryReader,
    Version,
)
from pipeline.core.faults import pause_point
from pipeline.core.store import deploys as audit
from pipeline.core.store.events import utcnow
from pipeline.core.types import ModelUpdate

ANY = object()  # promote(against=ANY): whatever the champion is
log = logging.getLogger("rtrl.deploy")


class Superseded(RegistryError):
    """An automatic promotion refused because people or events moved on: the version was rolled
    back, or the champion it was decided against is no longer the champion."""


class Registry(RegistryReader):
    """Reading (RegistryReader) and every write; see the module docstring."""

    # --- writing -------------------------------------------------------------------------
    def register(self, tracking_run_id: str, tags: dict[str, Any]) -> Version:
        """A new version from the run's `adapter` artifact, aliased `candidate`."""

        def create() -> Any:
            try:
                self.client.get_registered_model(self.name)
            except MlflowException:
                self.client.create_registered_model(self.name, description="LoRA adapters trained by rtrl")
            source = f"runs:/{tracking_run_id}/adapter"
            return self.client.create_model_version(
                self.name, source, run_id=tracking_run_id, tags={k: str(v) for k, v in tags.items()}
            )

        mv = self._call("registering the candidate", create)
        self._call(
            "setting the candidate alias",
            lambda: self.client.set_registered_model_alias(self.name, CANDIDATE, mv.version),
        )
        return self.get(mv.version)

    def tag(self, version: str, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self._call(
                f"tagging version {version}",
                lambda k=key, v=value: self.client.set_model_version_tag(self.name, version, k, str(v)[:5000]),
            )

    def record_decision(
        self, version: str, champion: str | None, run_id: str | None, decision: Decision, report: dict[str, Any]
    ) -> None:
        audit.record_decision(
            self.engine,
            self.name,
            version,
            champion,
            run_id,
            decision.passed,
            {"decision": decision.to_dict(), **report},
            fence=self.fence,
        )
        numbers = [
            {"check": c.name, "value": round(c.value, 6), "limit": c.limit}
            for c in decision.checks
            if c.value is not None
        ]
        # four tags (one registry call each); every number is in gate.numbers
        tags = {
            "gate.passed": str(decision.passed).lower(),
            "gate.champion": champion or "none",
            "gate.reasons": json.dumps(decision.reasons),
            "gate.numbers": json.dumps(numbers),
        }
        self.tag(version, tags)

    def record_online(
        self, version: str, champion: str | None, cycle_id: str, decision: Decision, sides: dict[str, Any]
    ) -> None:
        """A staged rollout's online decision (deploy/rollout.py): stored like a gate decision (the
        latest decision is what promote() goes by), with no run, and tagged on the version."""
        audit.record_decision(
            self.engine,
            self.name,
            version,
            champion,
            None,
            decision.passed,
            {"decision": decision.to_dict(), "stage": "online", "cycle": cycle_id, "sides": sides},
            fence=self.fence,
        )
        self.tag(
            version,
            {
                "online.passed": str(decision.passed).lower(),
                "online.reasons": json.dumps([c.detail for c in decision.checks]),
            },
        )

    def promote(
        self, version: str, actor: str, reason: str, force: bool = False, against: str | None | object = ANY
    ) -> bool:
        """Move `champion` to `version`; False if it already is (a no-op). A canary of that
        version is cleared: it serves everything now. `against` (a cycle's promotion): the
        champion its decision was made against; anything else is the champion now -> Superseded."""
        version = str(version)
        target = self.get(version)  # refuses an unknown version before anything is written
        current = self.alias(CHAMPION)
        if current is not None and current.version == version:
            self.withdraw_canary(version, actor, f"version {version} promoted")
            return False
        decision = self._require_passed(version, force, reason)
        if not force:
            undone = audit.rolled_back(self.engine, self.name, version)
            if undone is not None:
                raise Superseded(
                    f"version {version} was rolled back by {undone.actor} at {undone.at:%Y-%m-%d %H:%M:%S}"
                    f" ({undone.reason}); `rtrl promote {version} --force --reason '...'` promotes it again"
                )
            if against is not ANY and (current.version if current else None) != against:
                raise Superseded(
                    f"version {version} was decided against champion {against}, but the champion is "
                    f"now {current.version if current else 'none'} (moved meanwhile): gate it again"
                )
        why = reason or f"gate passed (decision {decision.id})"
        self._move(CHAMPION, target, current, actor, why, kind="promote", previous=current)
        self.withdraw_canary(version, actor, f"version {version} promoted")
        return True

    def stage(self, version: str, share: float, actor: str, reason: str) -> bool:
        """Move `canary` to `version`, serving `share` of requests; False if it already is."""
        version = str(version)
        if not 0.0 < share < 1.0:
            raise RegistryError(f"a canary's share of requests must be in (0, 1), not {share}")
        target = self.get(version)
        current = self.alias(CANARY)
        if current is not None and current.version == version:
            return False
        self._require_passed(version, False, reason)
        self.tag(version, {"rollout.share": share})  # read by a server starting while the canary is out
        self._move(CANARY, target, current, actor, reason, share=share, kind="stage")
        return True

    def unstage(self, actor: str, reason: str) -> Version | None:
        """Clear `canary` (all requests to the champion); the version it was, None if none."""
        current = self.alias(CANARY)
        if current is None:
            return None
        self._move(CANARY, None, current, actor, reason, kind="withdraw")
        return current

    def withdraw_canary(self, version: str, actor: str, reason: str) -> bool:
        """Clear `canary` if it is `version` (another canary is left alone); True if cleared."""
        canary = self.alias(CANARY)
        if canary is None or canary.version != version:
            return False
        self._move(CANARY, None, canary, actor, reason, kind="withdraw")
        return True

    def _require_passed(self, version: str, force: bool, reason: str) -> Any:
        """The version's latest decision, which must have passed unless forced with a reason."""
        decision = audit.latest_decision(self.engine, self.name, version)
        if not force:
            if decision is None:
                raise RegistryError(
                    f"version {version} has no gate decision: run `rtrl gate` on it, or "
                    "`rtrl promote VERSION --force --reason '...'` to override"
                )
            if not decision.passed:
                reasons = "; ".join(decision.reasons)
                raise RegistryError(
                    f"version {version} failed its gate ({reasons}); `--force --reason '...'` overrides"
                )
        elif not reason.strip():
            raise RegistryError("--force needs --reason: say why the gate is overridden")
        return decision

    def rollback(self, actor: str, reason: str, to: str | None = None, force: bool = False) -> Version:
        """`champion` back to `previous` (or `to`). The new `previous` is the champion the restored
        version replaced when it was promoted, so rollbacks walk back through the promotions; the
        version rolled back is not promoted again unless forced. `to` a version that was never the
        champion needs a passing decision, as a promotion does, unless forced with a reason."""
        current = self.alias(CHAMPION)
        target = self.get(to) if to else self.alias(PREVIOUS)
        if to and audit.last_move_to(self.engine, self.name, CHAMPION, target.version) is None:
            try:
                self._require_passed(target.version, force, reason)
            except RegistryError as exc:
                raise RegistryError(
                    f"version {target.version} was never the champion, so a rollback to it is a "
                    f"promotion: {exc}".replace(
                        "`--force --reason", f"`rtrl rollback --to {target.version} --force --reason"
                    )
                ) from None
        if target is None or (current is not None and target.version == current.version and not to):
            # `previous` missing, or equal to the champion (left so by an older version's failed
            # promotion): the audit trail knows what the champion replaced
            back = audit.promoted_from(self.engine, self.name, current.version) if current else None
            target = self.get(back) if back else None
        if target is None:
            raise RegistryError(
                f"model {self.name} has no `previous` version to roll back to; name one with --to VERSION"
            )
        if current is not None and current.version == target.version:
            raise RegistryError(f"version {target.version} is already the champion")
        back = audit.promoted_from(self.engine, self.name, target.version)
        previous = self.get(back) if back and back != target.version else None
        self._move(CHAMPION, target, current, actor, reason or "rollback", kind="rollback", previous=previous)
        return target

    def _move(
        self,
        alias: str,
        target: Version | None,
        current: Version | None,
        actor: str,
        reason: str,
        share: float | None = None,
        kind: str | None = None,
        previous: Version | None = None,
    ) -> None:
        """`alias` -> target (None: cleared). Moving `champion` also moves `previous` first (to
        `previous`; None clears it), and puts it back if the champion then does not move."""
        move_id = audit.begin_move(
            self.engine,
            self.name,
            alias,
            current.version if current else None,
            target.version if target else None,
            reason,
            actor,
            share=share,
            kind=kind,
            fence=self.fence,
        )
        was_previous, previous_moved = None, False
        try:
            if alias == CHAMPION:
                was_previous = self.alias(PREVIOUS)
                if (previous.version if previous else None) != (was_previous.version if was_previous else None):
                    self._set_alias(PREVIOUS, previous)
                    previous_moved = True
            self._set_alias(alias, target)
        except RegistryError as exc:
            audit.complete_move(self.engine, move_id, "not_applied")
            if previous_moved:
                try:
                    self._set_alias(PREVIOUS, was_previous)
                except RegistryError as again:
                    raise RegistryError(
                        f"{exc}; `previous` was moved and could not be put back to "
                        f"{was_previous.version if was_previous else 'none'}: {again}"
                    ) from None
            raise
        pause_point("promote.champion_moved")  # crash tests kill the process here: repair() finishes
        audit.complete_move(self.engine, move_id)
        self._publish(move_id, alias, target, share)

    def _set_alias(self, alias: str, target: Version | None) -> None:
        if target is None:
            if self.alias(alias) is not None:
                self._call(
                    f"clearing the {alias} alias", lambda: self.client.delete_registered_model_alias(self.name, alias)
                )
        else:
            self._call(
                f"moving the {alias} alias",
                lambda: self.client.set_registered_model_alias(self.name, alias, target.version),
            )

    def _publish(self, move_id: int, alias: str, target: Version | None, share: float | None) -> bool:
        """Announce the move; a broker that is down leaves the row unpublished for repair()."""
        if self.publish is None:
            return False
        event = ModelUpdate(
            alias,
            None if target is None else target.version,
            None if target is None else target.source,
            share=(share or 0.0) if alias == CANARY and target is not None else 0.0,
            name=self.name,
            seq=move_id,
            base_model=None if target is None else target.tags.get("base_model"),
            run_id=None if target is None else target.run_id,
            at=utcnow().isoformat() + "Z",
        )
        try:
            self.publish(event.to_dict())
        except Exception as exc:  # noqa: BLE001 - kafka errors of every kind
            log.warning(
                "model-update event not published; the next promote, rollback or gate retries it",
                extra={
                    "move_id": move_id,
                    "alias": alias,
                    "version": target.version if target else None,
                    "error": f"{type(exc).__name__}: {exc}",
                },
            )
            return False
        audit.mark_published(self.engine, move_id)
        return True

    def repair(self) -> list[str]:
        """Finish what a crash left half done; returns what was repaired, one line each."""
        done = []
        for row in audit.unfinished_moves(self.engine, self.name):
            if row.status == "pending":
                now = self.alias(row.alias)
                applied = (
                    (now is None or now.version != row.from_version)
                    if row.to_version is None
                    else (now is not None and now.version == row.to_version)
                )
                audit.complete_move(self.engine, row.id, "done" if applied else "not_applied")
                done.append(
                    f"move {row.id} ({row.alias}: {row.from_version} -> {row.to_version}): "
                    f"{'completed' if applied else 'never applied'}"
                )
                if not applied:
                    continue
            newer = audit.superseded_by(self.engine, row)
            if newer is not None:  # its event would undo the newer state on every follower
                audit.mark_published(self.engine, row.id)
                done.append(f"move {row.id}: event not sent, superseded by move {newer}")
                continue
            target = self.get(row.to_version) if row.to_version is not None else None
            if self._publish(row.id, row.alias, target, row.share):
                done.append(f"move {row.id}: model-update event published")
        return done
