//! The `read` toolset: `read_file` and `search_files`, with hermes-agent
//! 0.19's schemas and result shapes.

use std::io::{BufRead, BufReader, Read};

use serde_json::{Map, Value, json};

use crate::args::Args;
use crate::workspace::Workspace;
use retinue_core::run::ToolError;

/// The most characters one `read_file` result carries (hermes's read budget).
pub const MAX_READ_CHARS: usize = 100_000;
/// Longest line shown; longer ones end in `... [truncated]`.
pub const MAX_LINE_LENGTH: usize = 2000;
/// The most lines one read may ask for.
pub const MAX_LIMIT: u64 = 2000;
/// Bytes scanned to count a file's lines; a bigger file's total is a floor.
const COUNT_SCAN_BYTES: u64 = 64 << 20;
/// The most bytes one `read_file` scans (a far offset in a huge file, or
/// a file that keeps growing, ends here).
const MAX_SCAN_BYTES: u64 = 256 << 20;
/// The furthest `search_files` pages.
const MAX_SEARCH_OFFSET: u64 = 10_000;
/// Files larger than this are skipped by `search_files` content search.
const SEARCH_MAX_FILESIZE: u64 = 50 << 20;

/// `read_file`'s schema (hermes-agent 0.19).
pub fn read_file_schema() -> Value {
    json!({
        "name": "read_file",
        "description": "Read a text file with line numbers and pagination. Output format: 'LINE_NUM|CONTENT'. Use offset and limit for large files. Reads exceeding ~100K characters are truncated on a line boundary and return a next_offset; continue with offset to read the rest. Paths are relative to the workspace. NOTE: Cannot read images or other binary files.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "Path to the file to read (relative to the workspace, or absolute inside it)"},
                "offset": {"type": "integer", "description": "Line number to start reading from (1-indexed, default: 1)", "default": 1, "minimum": 1},
                "limit": {"type": "integer", "description": "Maximum number of lines to read (default: 500, max: 2000)", "default": 500, "maximum": 2000}
            },
            "required": ["path"]
        }
    })
}

/// `search_files`' schema (hermes-agent 0.19).
pub fn search_files_schema() -> Value {
    json!({
        "name": "search_files",
        "description": "Search file contents or find files by name. Use this instead of grep/rg/find/ls in terminal. Ripgrep-backed (honours .gitignore).\n\nContent search (target='content'): Regex search inside files. Output modes: full matches with line numbers, file paths only, or match counts.\n\nFile search (target='files'): Find files by glob pattern (e.g., '*.py', '*config*'). Also use this instead of ls — results sorted by modification time.",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "Regex pattern for content search, or glob pattern (e.g., '*.py') for file search"},
                "target": {"type": "string", "enum": ["content", "files"], "description": "'content' searches inside file contents, 'files' searches for files by name", "default": "content"},
                "path": {"type": "string", "description": "Directory or file to search in (default: the workspace)", "default": "."},
                "file_glob": {"type": "string", "description": "Filter files by pattern in grep mode (e.g., '*.py' to only search Python files)"},
                "limit": {"type": "integer", "description": "Maximum number of results to return (default: 50)", "default": 50},
                "offset": {"type": "integer", "description": "Skip first N results for pagination (default: 0)", "default": 0},
                "output_mode": {"type": "string", "enum": ["content", "files_only", "count"], "description": "Output format for grep mode: 'content' shows matching lines with line numbers, 'files_only' lists file paths, 'count' shows match counts per file", "default": "content"},
                "context": {"type": "integer", "description": "Number of context lines before and after each match (grep mode only)", "default": 0}
            },
            "required": ["pattern"]
        }
    })
}

fn clip_line(line: &str) -> std::borrow::Cow<'_, str> {
    if line.len() <= MAX_LINE_LENGTH {
        return std::borrow::Cow::Borrowed(line);
    }
    match line.char_indices().nth(MAX_LINE_LENGTH) {
        Some((at, _)) => std::borrow::Cow::Owned(format!("{}... [truncated]", &line[..at])),
        None => std::borrow::Cow::Borrowed(line),
    }
}

/// `read_file`.
pub fn read_file(ws: &Workspace, args: &Args<'_>) -> Result<String, ToolError> {
    let path = args.required_str("path")?;
    let offset = args.uint("offset", 1)?.max(1);
    let limit = args.uint("limit", 500)?.clamp(1, MAX_LIMIT);
    let inside = ws.inside(path)?;
    let (file, size) = ws.open_file(&inside)?;
    let mut reader = BufReader::with_capacity(16 << 10, file);
    // Binary check on the first block.
    {
        let head = reader.fill_buf().map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        if head.iter().take(8192).any(|b| *b == 0) {
            return Err(ToolError::Refused(format!(
                "`{path}` is a binary file ({size} bytes); read_file reads text only"
            )));
        }
    }
    // The rendered lines, `\n`-joined, and how many.
    let mut content = String::new();
    let mut shown: u64 = 0;
    let mut line_no: u64 = 0;
    let mut chars = 0usize;
    let mut cut_by_chars = false;
    let mut buf = Vec::new();
    let mut scanned: u64 = 0;
    let mut counted_all = true;
    loop {
        buf.clear();
        // Each line is read with a bound, so one endless line cannot fill memory.
        let n = (&mut reader)
            .take(4 * MAX_LINE_LENGTH as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
        if n == 0 {
            break;
        }
        scanned += n as u64;
        let ended = buf.last() == Some(&b'\n');
        if !ended && n > 4 * MAX_LINE_LENGTH {
            // The rest of an over-long line: skip to its end.
            let mut skip = Vec::new();
            loop {
                skip.clear();
                let m = (&mut reader)
                    .take(1 << 20)
                    .read_until(b'\n', &mut skip)
                    .map_err(|e| ToolError::Failed(format!("`{path}`: {e}")))?;
                scanned += m as u64;
                if m == 0 || skip.last() == Some(&b'\n') {
                    break;
                }
            }
        }
        line_no += 1;
        if line_no >= offset && line_no < offset.saturating_add(limit) && !cut_by_chars {
            let text = String::from_utf8_lossy(&buf);
            let text = text.trim_end_matches('\n').trim_end_matches('\r');
            let text = if line_no == 1 { text.trim_start_matches('\u{feff}') } else { text };
            let clipped = clip_line(text);
            let rendered = format!("{line_no}|{clipped}");
            // Counted in scalars (bytes would cut non-ASCII text short).
            let cost =
                if rendered.is_ascii() { rendered.len() } else { rendered.chars().count() } + 1;
            if chars + cost > MAX_READ_CHARS && shown > 0 {
                cut_by_chars = true;
            } else {
                chars += cost;
                if shown > 0 {
                    content.push('\n');
                }
                content.push_str(&rendered);
                shown += 1;
            }
        }
        if scanned > COUNT_SCAN_BYTES && (line_no >= offset.saturating_add(limit) || cut_by_chars) {
            counted_all = false;
            break;
        }
        if scanned > MAX_SCAN_BYTES {
            if line_no < offset {
                return Err(ToolError::Refused(format!(
                    "offset {offset} lies beyond the first {} MB of `{path}`, the most read_file \
                     scans",
                    MAX_SCAN_BYTES >> 20
                )));
            }
            counted_all = false;
            break;
        }
    }
    let total_lines = line_no;
    let mut out = Map::new();
    let end_line =
        if shown == 0 { offset.saturating_sub(1) } else { offset.saturating_add(shown - 1) };
    out.insert("content".into(), Value::String(content));
    out.insert("total_lines".into(), json!(total_lines));
    out.insert("file_size".into(), json!(size));
    let more = !counted_all || total_lines > end_line;
    out.insert("truncated".into(), json!(more));
    if cut_by_chars {
        let next = end_line.saturating_add(1);
        out.insert("truncated_by".into(), json!("bytes"));
        out.insert("next_offset".into(), json!(next));
        out.insert(
            "hint".into(),
            json!(format!(
                "Output truncated at the {MAX_READ_CHARS}-char read budget after {shown} line(s) \
                 (showing lines {offset}-{end_line} of {}). Use offset={next} to continue.",
                if counted_all {
                    total_lines.to_string()
                } else {
                    format!("at least {total_lines}")
                }
            )),
        );
    } else if more {
        out.insert(
            "hint".into(),
            json!(format!(
                "Use offset={} to continue reading (showing {offset}-{end_line} of {} lines)",
                end_line.saturating_add(1),
                if counted_all {
                    total_lines.to_string()
                } else {
                    format!("at least {total_lines}")
                }
            )),
        );
    }
    if shown == 0 && offset > total_lines && counted_all {
        out.insert(
            "error".into(),
            json!(format!("offset {offset} is past the end of the file ({total_lines} lines)")),
        );
    }
    Ok(Value::Object(out).to_string())
}

/// The `.gitignore` and `.ignore` rules of the directories a walk visits,
/// read through the workspace.
struct Ignores {
    ws: Workspace,
    cache: std::sync::Mutex<
        std::collections::HashMap<std::path::PathBuf, Option<ignore::gitignore::Gitignore>>,
    >,
}

/// The largest ignore file read.
const MAX_IGNORE_FILE: u64 = 1 << 20;

impl Ignores {
    fn rules(&self, dir: &std::path::Path) -> Option<ignore::gitignore::Gitignore> {
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = cache.get(dir) {
            return r.clone();
        }
        let rel = dir.strip_prefix(self.ws.root()).ok()?;
        let mut builder = ignore::gitignore::GitignoreBuilder::new(dir);
        let mut any = false;
        for name in [".gitignore", ".ignore"] {
            let Some(path) = rel.join(name).to_str().map(str::to_owned) else { continue };
            let Ok(inside) = self.ws.inside(&path) else { continue };
            let Ok((file, size)) = self.ws.open_file(&inside) else { continue };
            if size > MAX_IGNORE_FILE {
                continue;
            }
            let mut text = String::new();
            if file.take(MAX_IGNORE_FILE).read_to_string(&mut text).is_err() {
                continue;
            }
            for line in text.lines() {
                any |= builder.add_line(None, line).is_ok();
            }
        }
        let rules = if any { builder.build().ok() } else { None };
        cache.insert(dir.to_path_buf(), rules.clone());
        rules
    }

    /// Whether `path` is ignored by the rules of its ancestors (the
    /// deepest rule that matches decides).
    fn ignored(&self, path: &std::path::Path, is_dir: bool) -> bool {
        let root = self.ws.root();
        let mut verdict = false;
        let mut dirs: Vec<&std::path::Path> =
            path.ancestors().skip(1).take_while(|a| a.starts_with(root)).collect();
        dirs.reverse();
        for dir in dirs {
            if let Some(rules) = self.rules(dir) {
                match rules.matched(path, is_dir) {
                    ignore::Match::Ignore(_) => verdict = true,
                    ignore::Match::Whitelist(_) => verdict = false,
                    ignore::Match::None => {}
                }
            }
        }
        verdict
    }
}

struct Found {
    path: String,
    line: u64,
    content: String,
}

/// `search_files`.
pub fn search_files(ws: &Workspace, args: &Args<'_>) -> Result<String, ToolError> {
    let pattern = args.required_str("pattern")?;
    if pattern.is_empty() {
        return Err(ToolError::InvalidArguments("`pattern` must not be empty".to_owned()));
    }
    let target = match args.str_or("target", "content")? {
        "content" | "grep" => "content",
        "files" | "find" => "files",
        other => {
            return Err(ToolError::InvalidArguments(format!(
                "`target` must be `content` or `files`, not `{other}`"
            )));
        }
    };
    let limit = usize::try_from(args.uint("limit", 50)?.clamp(1, 1000)).unwrap_or(1000);
    let offset = usize::try_from(args.uint("offset", 0)?.min(MAX_SEARCH_OFFSET)).unwrap_or(0);
    let context = usize::try_from(args.uint("context", 0)?.min(10)).unwrap_or(0);
    let mode = args.str_or("output_mode", "content")?;
    if !matches!(mode, "content" | "files_only" | "count") {
        return Err(ToolError::InvalidArguments(format!(
            "`output_mode` must be `content`, `files_only` or `count`, not `{mode}`"
        )));
    }
    let start = ws.inside(args.str_or("path", ".")?)?;
    ws.check(&start)?;
    let file_glob = args.opt_str("file_glob")?.filter(|g| !g.trim().is_empty());
    let glob_of = |g: &str| -> Result<globset::GlobMatcher, ToolError> {
        globset::GlobBuilder::new(g)
            .literal_separator(false)
            .build()
            .map(|g| g.compile_matcher())
            .map_err(|e| ToolError::InvalidArguments(format!("invalid glob `{g}`: {e}")))
    };
    let name_glob = if target == "files" { Some(glob_of(pattern)?) } else { None };
    let content_glob = file_glob.map(glob_of).transpose()?;
    let walk_root = ws.root().join(start.rel());
    // ripgrep's walker, with its own ignore-file reading off: `.gitignore`
    // and `.ignore` files are read here, beneath the root (a FIFO, a
    // symlink or a huge file is skipped), so the walk never reads outside
    // the workspace or blocks.
    let ignores = Ignores { ws: ws.clone(), cache: Default::default() };
    let guard = ws.clone();
    let walker = ignore::WalkBuilder::new(&walk_root)
        .follow_links(false)
        .hidden(true)
        .parents(false)
        .ignore(false)
        .git_ignore(false)
        .git_global(false)
        .git_exclude(false)
        .require_git(false)
        .max_filesize(if target == "content" { Some(SEARCH_MAX_FILESIZE) } else { None })
        .sort_by_file_path(|a, b| a.cmp(b))
        .filter_entry(move |e| {
            // The home and the database are never listed.
            let hidden = e.path().strip_prefix(guard.root()).is_ok_and(|rel| guard.is_hidden(rel));
            !hidden && !ignores.ignored(e.path(), e.file_type().is_some_and(|t| t.is_dir()))
        })
        .build();
    let rel_of = |p: &std::path::Path| -> Option<String> {
        p.strip_prefix(ws.root()).ok().map(|r| crate::workspace::escaped(r.as_os_str()))
    };
    let mut out = Map::new();
    if target == "files" {
        let mut files: Vec<(String, std::time::SystemTime)> = Vec::new();
        for entry in walker.flatten() {
            if !entry.file_type().is_some_and(|t| t.is_file()) {
                continue;
            }
            let name = entry.file_name().to_string_lossy();
            let rel = rel_of(entry.path()).unwrap_or_default();
            if name_glob.as_ref().is_some_and(|g| g.is_match(name.as_ref()) || g.is_match(&rel)) {
                let mtime = entry
                    .metadata()
                    .ok()
                    .and_then(|m| m.modified().ok())
                    .unwrap_or(std::time::UNIX_EPOCH);
                files.push((rel, mtime));
            }
        }
        files.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let total = files.len();
        let page: Vec<String> = files.into_iter().skip(offset).take(limit).map(|f| f.0).collect();
        out.insert("total_count".into(), json!(total));
        if !page.is_empty() {
            out.insert("files".into(), json!(page));
        }
        if total > offset.saturating_add(limit) {
            out.insert("truncated".into(), json!(true));
        }
        return Ok(Value::Object(out).to_string());
    }
    let matcher = grep_regex::RegexMatcherBuilder::new()
        .size_limit(10 << 20)
        .dfa_size_limit(10 << 20)
        .build(pattern)
        .map_err(|e| ToolError::InvalidArguments(format!("invalid regex `{pattern}`: {e}")))?;
    let mut searcher = grep_searcher::SearcherBuilder::new()
        .binary_detection(grep_searcher::BinaryDetection::quit(0))
        .line_number(true)
        .before_context(context)
        .after_context(context)
        .build();
    let mut found: Vec<Found> = Vec::new();
    let mut counts: Vec<(String, u64)> = Vec::new();
    let mut total: usize = 0;
    // Enough results for the page (counting stops there, stated as truncated).
    let wanted = offset.saturating_add(limit);
    let mut stopped = false;
    for entry in walker.flatten() {
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        let Some(rel) = rel_of(entry.path()) else { continue };
        if let Some(g) = &content_glob
            && !(g.is_match(entry.file_name()) || g.is_match(&rel))
        {
            continue;
        }
        // Opened beneath the root (a file swapped for a link since the walk
        // saw it is refused, never followed).
        let Ok(inside) = ws.inside(&rel) else { continue };
        let Ok((file, size)) = ws.open_file(&inside) else { continue };
        if size > SEARCH_MAX_FILESIZE {
            continue;
        }
        let mut here: Vec<Found> = Vec::new();
        let mut hits: u64 = 0;
        let sink = Collect { path: &rel, found: &mut here, hits: &mut hits };
        if searcher.search_file(&matcher, &file, sink).is_err() {
            continue;
        }
        if hits == 0 {
            continue;
        }
        match mode {
            "count" => counts.push((rel, hits)),
            "files_only" => counts.push((rel, hits)),
            _ => {
                total = total.saturating_add(usize::try_from(hits).unwrap_or(usize::MAX));
                found.extend(here);
            }
        }
        if mode == "content" && found.len() >= wanted.saturating_add(1) {
            stopped = true;
            break;
        }
        if mode != "content" && counts.len() > wanted {
            stopped = true;
            break;
        }
    }
    match mode {
        "content" => {
            let page: Vec<Found> = found.into_iter().skip(offset).take(limit).collect();
            out.insert("total_count".into(), json!(total));
            if page.len() >= 5 {
                let mut text = Vec::new();
                let mut current: Option<&str> = None;
                for m in &page {
                    if current != Some(m.path.as_str()) {
                        text.push(m.path.clone());
                        current = Some(m.path.as_str());
                    }
                    text.push(format!("  {}: {}", m.line, m.content.trim_end()));
                }
                out.insert(
                    "matches_format".into(),
                    json!("path-grouped: each file path on its own line, followed by indented '<line>: <content>' rows for matches in that file"),
                );
                out.insert("matches_text".into(), json!(text.join("\n")));
            } else if !page.is_empty() {
                out.insert(
                    "matches".into(),
                    json!(
                        page.iter()
                            .map(|m| json!({"path": m.path, "line": m.line, "content": m.content}))
                            .collect::<Vec<_>>()
                    ),
                );
            }
        }
        "files_only" => {
            let files: Vec<String> =
                counts.iter().skip(offset).take(limit).map(|c| c.0.clone()).collect();
            out.insert("total_count".into(), json!(counts.len()));
            if !files.is_empty() {
                out.insert("files".into(), json!(files));
            }
        }
        _ => {
            let page: Map<String, Value> =
                counts.iter().skip(offset).take(limit).map(|c| (c.0.clone(), json!(c.1))).collect();
            out.insert("total_count".into(), json!(counts.iter().map(|c| c.1).sum::<u64>()));
            if !page.is_empty() {
                out.insert("counts".into(), Value::Object(page));
            }
        }
    }
    if stopped {
        out.insert("truncated".into(), json!(true));
        out.insert(
            "limit_reason".into(),
            json!(format!("stopped after {} results; use offset to page", wanted)),
        );
    }
    Ok(Value::Object(out).to_string())
}

struct Collect<'a> {
    path: &'a str,
    found: &'a mut Vec<Found>,
    hits: &'a mut u64,
}

impl grep_searcher::Sink for Collect<'_> {
    type Error = std::io::Error;

    fn matched(
        &mut self,
        _searcher: &grep_searcher::Searcher,
        m: &grep_searcher::SinkMatch<'_>,
    ) -> Result<bool, std::io::Error> {
        *self.hits += 1;
        self.push(m.line_number(), m.bytes());
        Ok(*self.hits < 10_000)
    }

    fn context(
        &mut self,
        _searcher: &grep_searcher::Searcher,
        c: &grep_searcher::SinkContext<'_>,
    ) -> Result<bool, std::io::Error> {
        self.push(c.line_number(), c.bytes());
        Ok(true)
    }
}

impl Collect<'_> {
    fn push(&mut self, line: Option<u64>, bytes: &[u8]) {
        let text = String::from_utf8_lossy(bytes);
        self.found.push(Found {
            path: self.path.to_owned(),
            line: line.unwrap_or(0),
            content: clip_line(text.trim_end_matches(['\n', '\r'])).into_owned(),
        });
    }
}
