//! The time text of `strftime_now`: C `strftime` directives over a Unix
//! time in UTC, and a per-thread cache of the last result.

use minijinja::value::Value;

thread_local! {
    /// The last `strftime_now` result of this thread: (second, format,
    /// text). Templates call it once or twice per rendering with the same
    /// format, and the text changes once a second at most.
    static LAST_STRFTIME: std::cell::RefCell<Option<(i64, Box<str>, Value)>> =
        const { std::cell::RefCell::new(None) };
}

/// [`strftime`] as a template value, reusing this thread's last result when
/// the second and the format are the same (the text is a function of both
/// alone, whatever clock gave the second).
pub(crate) fn strftime_cached(format: &str, unix_seconds: i64) -> Value {
    LAST_STRFTIME.with_borrow_mut(|last| {
        if let Some((seconds, last_format, text)) = last
            && *seconds == unix_seconds
            && **last_format == *format
        {
            return text.clone();
        }
        let text = Value::from(strftime(format, unix_seconds));
        *last = Some((unix_seconds, format.into(), text.clone()));
        text
    })
}

/// Formats a Unix time (UTC) with the C `strftime` directives chat templates
/// use: `%d %m %Y %y %b %B %a %A %H %M %S %j %p %I %e %%` and the `%-d`/`%-m`
/// (no padding) forms. Unknown directives are copied as written.
pub fn strftime(format: &str, unix_seconds: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        match spec {
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('m') => out.push_str(&num(month, 2)),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num((hour + 11) % 12 + 1, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 12:34:56 UTC was a Friday.
        let t = 1_721_997_296;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-07-26 12:34:56");
        assert_eq!(strftime("%A %B %-d, %j %%", t), "Friday July 26, 208 %");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime("%Y-%m-%d", -86_400), "1969-12-31");
        assert_eq!(strftime("%q", t), "%q");
    }

    #[test]
    fn strftime_now_follows_the_second_and_the_format() {
        let t = 1_721_997_296;
        // Repeated, interleaved and changing calls on one thread: each
        // answer is strftime's own for that second and format.
        for (format, seconds) in [
            ("%Y-%m-%d", t),
            ("%Y-%m-%d", t),
            ("%H:%M:%S", t),
            ("%Y-%m-%d", t),
            ("%H:%M:%S", t + 1),
            ("%H:%M:%S", t + 1),
            ("%d %b %Y", t + 86_400),
        ] {
            assert_eq!(
                strftime_cached(format, seconds).as_str(),
                Some(strftime(format, seconds).as_str()),
                "{format} at {seconds}"
            );
        }
    }
}
