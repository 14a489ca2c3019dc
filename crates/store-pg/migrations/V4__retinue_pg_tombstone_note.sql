-- An operator's tombstone keeps its reason `manual` and its text as a note
-- (issue #12), as the SQLite backend's `retinue_children.tombstone_note`.
ALTER TABLE retinue_children ADD COLUMN IF NOT EXISTS tombstone_note TEXT;
