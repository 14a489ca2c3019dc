//! The documentation's shape: every relative link and `#anchor` in the
//! Markdown files (README.md, ARCHITECTURE.md, docs/, crate READMEs)
//! resolves, and the two entry documents stay short (README.md ≤ 250
//! lines, ARCHITECTURE.md ≤ 400: the rest belongs in docs/ and rustdoc).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The longest README.md and ARCHITECTURE.md may be, in lines.
const LIMITS: &[(&str, usize)] = &[("README.md", 250), ("ARCHITECTURE.md", 400)];

/// Runs the checks; each problem is one line.
pub(crate) fn check(root: &Path, problems: &mut Vec<String>) {
    for (name, max) in LIMITS {
        match fs::read_to_string(root.join(name)) {
            Ok(text) if text.lines().count() > *max => problems.push(format!(
                "{name}: {} lines (at most {max}; move the rest into docs/)",
                text.lines().count()
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("{name}: {e}")),
        }
    }
    let mut anchors = BTreeMap::new();
    for file in markdown_files(root) {
        let rel = file.strip_prefix(root).unwrap_or(&file).display().to_string();
        let Ok(text) = fs::read_to_string(&file) else {
            problems.push(format!("{rel}: unreadable"));
            continue;
        };
        for (line, target) in links(&text) {
            if let Some(why) = broken(&file, &target, &mut anchors) {
                problems.push(format!("{rel}:{line}: link `{target}`: {why}"));
            }
        }
    }
}

/// README.md, ARCHITECTURE.md, docs/**.md and every crate's README.md.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> =
        ["README.md", "ARCHITECTURE.md"].iter().map(|n| root.join(n)).collect();
    let mut stack = vec![root.join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    for entry in fs::read_dir(root.join("crates")).into_iter().flatten().flatten() {
        let readme = entry.path().join("README.md");
        if readme.is_file() {
            out.push(readme);
        }
    }
    out.sort();
    out
}

/// The lines outside fenced code blocks (`None` for a line inside one).
fn prose(text: &str) -> Vec<Option<&str>> {
    let mut fence: Option<String> = None;
    text.lines()
        .map(|line| {
            let t = line.trim_start();
            let marker: String =
                t.chars().take_while(|c| *c == '`' || *c == '~').collect::<String>();
            let is_fence =
                marker.len() >= 3 && marker.chars().all(|c| c == marker.as_bytes()[0] as char);
            match &fence {
                None if is_fence => {
                    fence = Some(marker);
                    None
                }
                Some(open) if is_fence && marker.starts_with(open.as_str()) => {
                    fence = None;
                    None
                }
                Some(_) => None,
                None => Some(line),
            }
        })
        .collect()
}

/// `line` without its inline code spans.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// Every relative link target `[text](target)` with its 1-based line.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose(text).into_iter().enumerate() {
        let Some(line) = line else { continue };
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let inner = rest[..end].trim();
            let target = inner
                .split_whitespace()
                .next()
                .unwrap_or("")
                .trim_start_matches('<')
                .trim_end_matches('>');
            rest = &rest[end..];
            if target.is_empty() || has_scheme(target) {
                continue;
            }
            out.push((i + 1, target.to_owned()));
        }
    }
    out
}

/// `https:`, `mailto:`… (a scheme: a letter, then letters, digits, `+-.`, then `:`).
fn has_scheme(target: &str) -> bool {
    let Some((scheme, _)) = target.split_once(':') else { return false };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

/// Why `target`, linked from `from`, does not resolve; `None` if it does.
fn broken(
    from: &Path,
    target: &str,
    anchors: &mut BTreeMap<PathBuf, BTreeSet<String>>,
) -> Option<String> {
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        normalize(&from.parent().unwrap_or(Path::new(".")).join(path))
    };
    if !file.exists() {
        return Some("no such file".to_owned());
    }
    let fragment = fragment.filter(|f| !f.is_empty())?;
    if file.extension().is_none_or(|e| e != "md") {
        // A line anchor into a source file (`#L10`) is GitHub's, not ours.
        return (!fragment.starts_with('L')).then(|| "an anchor into a non-Markdown file".into());
    }
    let known = anchors
        .entry(file.clone())
        .or_insert_with(|| fs::read_to_string(&file).map(|t| anchors_of(&t)).unwrap_or_default());
    (!known.contains(fragment)).then(|| "no such heading".to_owned())
}

/// `a/./b/../c` → `a/c`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The anchors GitHub gives a Markdown file's headings (duplicates get
/// `-1`, `-2`…), plus explicit `<a name="…">`/`id="…"`.
fn anchors_of(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in prose(text).into_iter().flatten() {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let heading = line[hashes..].trim().trim_end_matches('#').trim();
            let slug = slug(heading);
            match seen.get_mut(&slug) {
                Some(n) => {
                    *n += 1;
                    out.insert(format!("{slug}-{n}"));
                }
                None => {
                    seen.insert(slug.clone(), 0);
                    out.insert(slug);
                }
            }
        }
        for key in ["name=\"", "id=\""] {
            let mut rest = line;
            while let Some(at) = rest.find(key) {
                rest = &rest[at + key.len()..];
                if let Some(end) = rest.find('"') {
                    out.insert(rest[..end].to_owned());
                }
            }
        }
    }
    out
}

/// GitHub's heading slug: link text kept, code ticks and tags dropped,
/// lowercase, letters/digits/`-`/`_` kept, spaces to `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](url)` → `text`.
    while let Some(open) = rest.find('[') {
        text.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match (after.find("]("), after.find(')')) {
            (Some(close), Some(end)) if close < end => {
                text.push_str(&after[..close]);
                rest = &after[end + 1..];
            }
            _ => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    let mut out = String::new();
    let (mut in_tag, mut in_code) = (false, false);
    for c in text.trim().chars() {
        match c {
            '`' => in_code = !in_code,
            // Inside a code span `<` is text (GitHub drops it as punctuation).
            '<' if !in_code => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if in_tag => {}
            ' ' => out.push('-'),
            '-' | '_' => out.push(c),
            c if c.is_alphanumeric() => out.extend(c.to_lowercase()),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{anchors_of, has_scheme, links, slug};

    #[test]
    fn slugs_follow_github() {
        assert_eq!(
            slug("Team mode: the registry on PostgreSQL"),
            "team-mode-the-registry-on-postgresql"
        );
        assert_eq!(
            slug("See the subagent tree: `retinue serve`"),
            "see-the-subagent-tree-retinue-serve"
        );
        assert_eq!(slug("Issue #41 — tail latency"), "issue-41--tail-latency");
        assert_eq!(slug("[Link](x.md) and <b>bold</b>"), "link-and-bold");
        assert_eq!(slug("The `Arc<dyn Delegate>` capability"), "the-arcdyn-delegate-capability");
    }

    #[test]
    fn duplicate_headings_are_numbered_and_code_is_skipped() {
        let text = "# A\n## A\n```sh\n# not a heading\n```\n<a name=\"x\"></a>\n";
        let anchors: Vec<String> = anchors_of(text).into_iter().collect();
        assert_eq!(anchors, ["a", "a-1", "x"]);
    }

    #[test]
    fn links_skip_urls_and_code() {
        let text = "see [a](docs/a.md#b), [u](https://x.y), `[c](nope.md)`\n```\n[d](e.md)\n```\n";
        assert_eq!(links(text), [(1, "docs/a.md#b".to_owned())]);
        assert!(has_scheme("mailto:a@b") && !has_scheme("docs/a.md"));
    }
}
