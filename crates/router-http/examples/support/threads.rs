//! Thread helpers the router-http examples share: a named thread with a
//! current-thread tokio runtime of its own, and that thread's CPU time as
//! the kernel counts it (the most reliable figure on a shared machine).

/// Runs `f` on a new thread named `name` with its own current-thread
/// runtime, returns what `f` returned, and keeps the runtime running (its
/// spawned tasks alive) for the rest of the program.
/// The name of every runtime's blocking threads (`spawn_blocking`): in
/// the overhead example only the router's use them, for its tokenizer pool.
#[allow(dead_code)] // not every example reads it
pub(crate) const BLOCKING_THREAD_NAME: &str = "blocking-pool";

pub(crate) fn spawn_runtime<T: Send + 'static>(
    name: &str,
    f: impl FnOnce(&tokio::runtime::Runtime) -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name(BLOCKING_THREAD_NAME)
                .build()
                .expect("runtime");
            let value = f(&runtime);
            tx.send(value).expect("main thread waits");
            runtime.block_on(std::future::pending::<()>());
        })
        .expect("thread");
    rx.recv().expect("runtime started")
}

/// This thread's kernel id.
pub(crate) fn thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|path| path.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// Clock ticks thread `tid` of this process spent in user space and in
/// the kernel (`/proc/self/task/TID/stat` fields 14 and 15; 100 per
/// second): coarse, but over a whole measurement it splits the on-CPU time
/// into the router's own code and the kernel's (its TCP work, and on
/// loopback the receive side of every packet it sends, including waking
/// the load generator's and the upstream's threads).
pub(crate) fn thread_user_system_ticks(tid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    // The command name may hold spaces: fields are counted after its ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let field = |n: usize| fields.get(n).and_then(|f| f.parse().ok()).unwrap_or(0);
    // Field 14 (utime) is the 12th after the name and state.
    (field(11), field(12))
}

/// On-CPU nanoseconds of thread `tid` of this process.
pub(crate) fn thread_cpu_ns(tid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
