//! The `file` toolset's writers: `write_file` and `patch` (mode `replace`),
//! with hermes-agent 0.19's schemas and result shapes.

use std::io::Read;
use std::time::Duration;

use serde_json::{Value, json};

use crate::args::Args;
use crate::workspace::Workspace;
use retinue_core::run::ToolError;

/// The largest file `patch` edits (and the largest it may produce).
const PATCH_MAX_BYTES: u64 = 16 << 20;
/// The longest diff a `patch` result shows.
const MAX_DIFF_CHARS: usize = 50_000;

/// `write_file`'s schema (hermes-agent 0.19, without the profile guard).
pub fn write_file_schema() -> Value {
    json!({
        "name": "write_file",
        "description": "Write content to a file, completely replacing existing content. Use this instead of echo/cat heredoc in terminal. Creates parent directories automatically. OVERWRITES the entire file — use 'patch' for targeted edits. Paths are relative to the workspace.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path to the file to write (will be created if it doesn't exist, overwritten if it does)"},
                "content": {"type": "string", "description": "Complete content to write to the file"}
            },
            "required": ["path", "content"]
        }
    })
}

/// `patch`'s schema (hermes-agent 0.19; V4A `mode: patch` is not
/// supported yet, as its description says).
pub fn patch_schema() -> Value {
    json!({
        "name": "patch",
        "description": "Targeted find-and-replace edits in files. Use this instead of sed/awk in terminal. Returns a unified diff.\n\nREPLACE MODE (mode='replace', default): find a unique string and replace it. REQUIRED PARAMETERS: mode, path, old_string, new_string. Matching is exact (no fuzzy strategies).\nPATCH MODE (mode='patch', V4A multi-file patches) is not supported here yet: use replace mode, one edit per call.",
        "parameters": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["replace", "patch"], "description": "Edit mode. 'replace' (default): requires path + old_string + new_string. 'patch' is not supported yet.", "default": "replace"},
                "path": {"type": "string", "description": "REQUIRED when mode='replace'. File path to edit."},
                "old_string": {"type": "string", "description": "REQUIRED when mode='replace'. Exact text to find and replace. Must be unique in the file unless replace_all=true. Include surrounding context lines to ensure uniqueness."},
                "new_string": {"type": "string", "description": "REQUIRED when mode='replace'. Replacement text. Pass empty string '' to delete the matched text."},
                "replace_all": {"type": "boolean", "description": "Replace all occurrences instead of requiring a unique match (default: false)", "default": false},
                "patch": {"type": "string", "description": "V4A patch content (mode='patch'; not supported yet)."}
            },
            "required": ["mode"]
        }
    })
}

/// `write_file`.
pub fn write_file(ws: &Workspace, args: &Args<'_>) -> Result<String, ToolError> {
    let path = args.required_str("path")?;
    let content = args.opt_str("content")?.ok_or_else(|| {
        ToolError::InvalidArguments(
            "write_file: missing required field 'content'. Re-emit the tool call with the full \
             content."
                .to_owned(),
        )
    })?;
    let inside = ws.inside(path)?;
    let dirs_created = ws.replace_file(&inside, content.as_bytes())?;
    Ok(json!({"bytes_written": content.len(), "dirs_created": dirs_created}).to_string())
}

/// `patch` (mode `replace`).
pub fn patch(ws: &Workspace, args: &Args<'_>) -> Result<String, ToolError> {
    let mode = args.str_or("mode", "replace")?;
    match mode {
        "replace" => {}
        "patch" => {
            return Err(ToolError::InvalidArguments(
                "patch: mode 'patch' (V4A) is not supported yet; use mode 'replace' with path, \
                 old_string and new_string"
                    .to_owned(),
            ));
        }
        other => {
            return Err(ToolError::InvalidArguments(format!("patch: unknown mode `{other}`")));
        }
    }
    let path = args.required_str("path")?;
    let (Some(old), Some(new)) = (args.opt_str("old_string")?, args.opt_str("new_string")?) else {
        return Err(ToolError::InvalidArguments("old_string and new_string required".to_owned()));
    };
    if old.is_empty() {
        return Err(ToolError::InvalidArguments(
            "patch: `old_string` is empty; give the exact text to replace (use write_file to \
             create a file)"
                .to_owned(),
        ));
    }
    let replace_all = args.boolean("replace_all", false)?;
    let inside = ws.inside(path)?;
    ws.guard_write(&inside)?;
    let (file, size) = ws.open_file(&inside)?;
    if size > PATCH_MAX_BYTES {
        return Err(ToolError::Refused(format!(
            "`{path}` is {size} bytes; patch edits files up to {PATCH_MAX_BYTES} bytes"
        )));
    }
    let mut bytes = Vec::new();
    file.take(PATCH_MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
    let before = String::from_utf8(bytes)
        .map_err(|_| ToolError::Refused(format!("`{path}` is not UTF-8 text; patch edits text")))?;
    let count = before.matches(old).count();
    if count == 0 {
        return Err(ToolError::Failed(format!(
            "Could not find the old_string in `{path}` (matching is exact, whitespace included); \
             read the file and copy the text to replace"
        )));
    }
    if count > 1 && !replace_all {
        return Err(ToolError::Failed(format!(
            "old_string appears {count} times in `{path}`; include more surrounding context to \
             make it unique, or set replace_all=true"
        )));
    }
    // The result's size is known before it is built: a replacement that
    // would grow the file past the limit is refused, not allocated.
    let replaced = if replace_all { count } else { 1 };
    // (`replaced` matches of `old` lie in `before`, so the subtraction holds.)
    let size_after =
        (before.len() - replaced * old.len()).saturating_add(replaced.saturating_mul(new.len()));
    if size_after as u64 > PATCH_MAX_BYTES {
        return Err(ToolError::Refused(format!(
            "the edit would make `{path}` larger than {PATCH_MAX_BYTES} bytes"
        )));
    }
    let after = if replace_all { before.replace(old, new) } else { before.replacen(old, new, 1) };
    ws.replace_file(&inside, after.as_bytes())?;
    let shown = inside.shown();
    // The diff is bounded in time (a pathological edit falls back to a
    // coarser diff) and in size.
    let mut diff = similar::TextDiff::configure()
        .timeout(Duration::from_secs(1))
        .diff_lines(&before, &after)
        .unified_diff()
        .context_radius(3)
        .header(&format!("a/{shown}"), &format!("b/{shown}"))
        .to_string();
    if diff.len() > MAX_DIFF_CHARS {
        let mut cut = MAX_DIFF_CHARS;
        while !diff.is_char_boundary(cut) {
            cut -= 1;
        }
        diff.truncate(cut);
        diff.push_str("\n[diff cut: read the file for the rest]");
    }
    Ok(json!({"success": true, "diff": diff, "files_modified": [shown]}).to_string())
}
