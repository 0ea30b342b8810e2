//! /proc

/// A `kB` field of `/proc/PID/status` (VmRSS, VmHWM), in bytes.
pub(super) fn status_field(status: &str, field: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kb * 1024)
    })
}

pub(super) fn read_status(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status")).ok()
}

/// CPU time (user + system) of a process, in clock ticks, from
/// `/proc/PID/stat` (fields 14 and 15; the command name may hold spaces,
/// so fields are counted after its closing parenthesis).
pub(super) fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat)
}

pub(super) fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(unix)]
pub(super) fn ticks_per_second() -> f64 {
    // SAFETY: sysconf takes a constant and only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

#[cfg(not(unix))]
pub(super) fn ticks_per_second() -> f64 {
    100.0
}

pub(super) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub(super) const MIB: f64 = 1024.0 * 1024.0;
