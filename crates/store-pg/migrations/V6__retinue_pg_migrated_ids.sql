-- `retinue migrate` reruns (issue #22): the target id of every transcript
-- and ledger row copied from a state.db, per source file. A source id the
-- target already uses for another row (a team-mode write since the last
-- run) gets a fresh id here, so ids never collide and a rerun recognises
-- what it copied. Additive only.
CREATE TABLE IF NOT EXISTS retinue_migrated_ids (
    source TEXT COLLATE "C" NOT NULL,
    tbl TEXT COLLATE "C" NOT NULL,
    source_id BIGINT NOT NULL,
    target_id BIGINT NOT NULL,
    PRIMARY KEY (source, tbl, source_id)
);
