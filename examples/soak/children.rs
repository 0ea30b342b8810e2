//! Child processes

use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use super::clients::{MAX_RESPONSE_BYTES, connect};
use super::run::{Interrupt, Stop};

/// A child process this soak started; killed by its pid when dropped.
pub(super) struct Proc {
    name: String,
    child: Child,
    pub(super) log: PathBuf,
}

impl Proc {
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Still running? `Err` says how it ended.
    pub(super) fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "{} (pid {}) exited ({status}); its output: {}\n{}",
                self.name,
                self.pid(),
                self.log.display(),
                log_tail(&self.log, 15)
            )),
            Err(e) => Err(format!("cannot check {}: {e}", self.name)),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGKILL to exactly this pid (std's Child::kill), then reap it so
        // no zombie outlives the run. An already exited child is only reaped.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The last `lines` lines of a log file, indented.
pub(super) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Longest stdout line of a child that is looked at for its banner.
const MAX_LINE: u64 = 64 * 1024;

/// Starts `program` with `args`; its stdout and stderr go to `log`, and the
/// first stdout line for which `find` returns `Some` is sent back (then the
/// thread keeps copying, so the child never blocks on a full pipe).
pub(super) fn spawn_child(
    name: &str,
    program: &Path,
    args: &[String],
    log: PathBuf,
    find: fn(&str) -> Option<String>,
) -> Result<(Proc, std::sync::mpsc::Receiver<String>), String> {
    let err_file = std::fs::File::create(&log)
        .map_err(|e| format!("cannot create the log file {}: {e}", log.display()))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err_file));
    die_with_parent(&mut command);
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {} ({}): {e}", name, program.display()))?;
    let stdout = child.stdout.take();
    let (found_tx, found_rx) = std::sync::mpsc::channel();
    let log_path = log.clone();
    if let Some(stdout) = stdout {
        std::thread::spawn(move || {
            let mut sink: Box<dyn std::io::Write> =
                match std::fs::OpenOptions::new().append(true).open(&log_path) {
                    Ok(file) => Box::new(file),
                    Err(_) => Box::new(std::io::sink()),
                };
            let mut reader = BufReader::new(stdout);
            let mut line = Vec::new();
            loop {
                line.clear();
                // A line is bounded: a child printing without end cannot
                // make this thread grow.
                match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let _ = sink.write_all(&line);
                if let Some(found) = find(String::from_utf8_lossy(&line).trim_end()) {
                    let _ = found_tx.send(found);
                    break;
                }
            }
            // Found: the rest goes to the log byte for byte.
            let _ = std::io::copy(&mut reader, &mut sink);
        });
    }
    Ok((
        Proc {
            name: name.to_owned(),
            child,
            log,
        },
        found_rx,
    ))
}

/// On Linux the child gets SIGKILL when the thread that started it (the
/// soak's main thread) dies, even by SIGKILL: nothing survives the soak.
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only prctl, which is async-signal-safe; it touches no memory of the
    // parent and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}

/// `http://127.0.0.1:PORT` from engine-sim's banner
/// ("engine-sim ID (regular) serving MODEL on http://127.0.0.1:PORT").
pub(super) fn engine_url(line: &str) -> Option<String> {
    let (_, url) = line.rsplit_once(" on ")?;
    (line.starts_with("engine-sim ") && url.starts_with("http://")).then(|| url.trim().to_owned())
}

/// `http://127.0.0.1:PORT` from the router's banner
/// ("affinity-router 0.1.0 serving on http://127.0.0.1:PORT (policy ...)").
pub(super) fn router_url(line: &str) -> Option<String> {
    let rest = line.split_once(" serving on ")?.1;
    let url = rest.split_whitespace().next()?;
    (line.starts_with("affinity-router ") && url.starts_with("http://")).then(|| url.to_owned())
}

/// Waits for the line `rx` reports, watching the child and the clock.
pub(super) async fn wait_for_line(
    interrupt: &Interrupt,
    proc: &mut Proc,
    rx: &std::sync::mpsc::Receiver<String>,
    timeout: Duration,
    what: &str,
) -> Result<String, Stop> {
    let deadline = Instant::now() + timeout;
    loop {
        if interrupt.is_set() {
            return Err(Stop::Interrupted);
        }
        if let Ok(line) = rx.try_recv() {
            return Ok(line);
        }
        proc.check_alive()?;
        if Instant::now() > deadline {
            return Err(Stop::Failed(format!(
                "{} (pid {}) did not print {what} within {} s; its output:\n{}",
                proc.name,
                proc.pid(),
                timeout.as_secs(),
                log_tail(&proc.log, 15)
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// GET `path` on a fresh connection; the status code.
pub(super) async fn get_status(addr: SocketAddr, path: &'static str) -> Result<u16, String> {
    let mut sender = connect(addr).await?;
    let mut request = http::Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = http::Uri::from_static(path);
    if let Ok(host) = http::HeaderValue::try_from(addr.to_string()) {
        request.headers_mut().insert(http::header::HOST, host);
    }
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    let status = response.status().as_u16();
    let _ = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await;
    Ok(status)
}

pub(super) fn socket_addr(url: &str) -> Result<SocketAddr, String> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("cannot read an address from {url:?}: {e}"))
}
