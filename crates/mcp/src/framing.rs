//! The stdio framing in front of the SDK: one JSON-RPC message per line. A
//! line the SDK would drop in silence — not JSON, not a JSON-RPC message,
//! or [`MAX_MESSAGE_BYTES`] or longer — is answered here with a JSON-RPC
//! error (`-32700` parse error, `-32600` invalid request), so a client never
//! waits forever for a reply that will not come.

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

/// The longest message accepted (bytes, without the newline); the SDK's own
/// limit is 16 MiB, so a longer line never reaches it.
pub(crate) const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024 - 1;

/// JSON-RPC's parse error.
const PARSE_ERROR: i64 = -32700;
/// JSON-RPC's invalid request.
const INVALID_REQUEST: i64 = -32600;

fn error_line(id: &Value, code: i64, message: &str) -> String {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}).to_string()
}

/// What to do with one line: forward it to the SDK, or answer it here.
pub(crate) fn check_line(line: &[u8]) -> Result<(), String> {
    let value: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            return Err(error_line(&Value::Null, PARSE_ERROR, &format!("Parse error: {e}")));
        }
    };
    let one = |m: &Value| {
        m.get("jsonrpc").and_then(Value::as_str) == Some("2.0")
            && (m.get("method").is_some_and(Value::is_string)
                || m.get("result").is_some()
                || m.get("error").is_some())
    };
    let ok = match &value {
        Value::Object(_) => one(&value),
        Value::Array(batch) => !batch.is_empty() && batch.iter().all(one),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        let id = value.get("id").cloned().unwrap_or(Value::Null);
        Err(error_line(&id, INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message"))
    }
}

/// The SDK's end of the framing, and the task that writes its output.
pub(crate) type Framed =
    (tokio::io::DuplexStream, tokio::io::DuplexStream, tokio::task::JoinHandle<()>);

/// Puts the framing between `input`/`output` and the SDK: returns the
/// reader and writer to give the SDK, and the writer task (await it after
/// the SDK stops, so no last answer is lost). Two tasks run until `input`
/// ends and the SDK closes its writer.
pub(crate) fn spawn<R, W>(input: R, mut output: W) -> Framed
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (sdk_in, mut feed) = tokio::io::duplex(1 << 20);
    let (sdk_out, from_sdk) = tokio::io::duplex(1 << 20);
    let (answers, mut answered) = mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut reader = BufReader::new(input);
        loop {
            let mut line = Vec::new();
            let limit = u64::try_from(MAX_MESSAGE_BYTES + 1).unwrap_or(u64::MAX);
            match (&mut reader).take(limit).read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let ended = line.last() == Some(&b'\n');
            if !ended && line.len() > MAX_MESSAGE_BYTES {
                // Skip the rest of the oversized line, then answer it.
                let mut rest = Vec::new();
                loop {
                    rest.clear();
                    match (&mut reader).take(1 << 20).read_until(b'\n', &mut rest).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) if rest.last() == Some(&b'\n') => break,
                        Ok(_) => {}
                    }
                }
                let text = format!(
                    "Invalid Request: a message of more than {MAX_MESSAGE_BYTES} bytes is refused"
                );
                let _ = answers.send(error_line(&Value::Null, INVALID_REQUEST, &text));
                continue;
            }
            let body = line.trim_ascii();
            if body.is_empty() {
                continue;
            }
            match check_line(body) {
                Ok(()) => {
                    let forwarded = async {
                        feed.write_all(body).await?;
                        feed.write_all(b"\n").await?;
                        feed.flush().await
                    };
                    if forwarded.await.is_err() {
                        break;
                    }
                }
                Err(answer) => {
                    let _ = answers.send(answer);
                }
            }
        }
        // End of input: the SDK sees end of file.
        let _ = feed.shutdown().await;
    });
    let writer = tokio::spawn(async move {
        let mut lines = BufReader::new(from_sdk).lines();
        let mut answers_open = true;
        loop {
            let line = tokio::select! {
                l = lines.next_line() => match l {
                    Ok(Some(l)) => l,
                    _ => break,
                },
                a = answered.recv(), if answers_open => match a {
                    Some(a) => a,
                    None => {
                        answers_open = false;
                        continue;
                    }
                },
            };
            let written = async {
                output.write_all(line.as_bytes()).await?;
                output.write_all(b"\n").await?;
                output.flush().await
            };
            if written.await.is_err() {
                break;
            }
        }
        // The SDK is done: answer what is still queued.
        while let Ok(a) = answered.try_recv() {
            let _ = output.write_all(format!("{a}\n").as_bytes()).await;
        }
        let _ = output.flush().await;
    });
    (sdk_in, sdk_out, writer)
}

#[cfg(test)]
mod tests {
    use super::check_line;

    #[test]
    fn lines_that_are_not_json_rpc_are_answered() {
        assert!(check_line(br#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#).is_ok());
        assert!(check_line(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#).is_ok());
        let parse = check_line(b"{not json").err().unwrap_or_default();
        assert!(parse.contains("-32700") && parse.contains("\"id\":null"), "{parse}");
        let invalid = check_line(br#"{"id":7,"hello":1}"#).err().unwrap_or_default();
        assert!(invalid.contains("-32600") && invalid.contains("\"id\":7"), "{invalid}");
        assert!(check_line(b"42").is_err());
        assert!(check_line(b"[]").is_err());
    }
}
