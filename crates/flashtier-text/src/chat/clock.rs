//! `strftime_now(format)` for chat templates (Llama 3.x writes the date
//! into its system prompt with it).
//!
//! transformers calls `datetime.now().strftime(format)`, the local time;
//! this renders UTC (servers run in UTC; a process has no portable way to
//! learn its zone without a time-zone database). Supported directives:
//! `%a %A %b %B %d %e %F %H %I %j %m %M %p %S %T %y %Y %Z %z %%`, and the
//! glibc `-` flag (`%-d`) that drops the padding; any other directive is
//! written as it is. The work is linear in the format's length.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
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

/// A UTC calendar time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CivilTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday
    pub weekday: u32,
    /// 1..=366
    pub yearday: u32,
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

impl CivilTime {
    /// The calendar time `secs` seconds after 1970-01-01T00:00:00Z (the
    /// days-to-civil algorithm on a 400-year era).
    pub(crate) fn from_unix(secs: i64) -> CivilTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let month_index = usize::try_from(month - 1).unwrap_or(0).min(11);
        let leap_day = i64::from(month > 2 && is_leap(year));
        let yearday = cumulative[month_index] + day + leap_day;
        // 1970-01-01 was a Thursday (index 3 counting from Monday).
        let weekday = (days + 3).rem_euclid(7);
        let narrow = |v: i64| u32::try_from(v).unwrap_or(0);
        CivilTime {
            year,
            month: narrow(month),
            day: narrow(day),
            hour: narrow(rem / 3600),
            minute: narrow(rem % 3600 / 60),
            second: narrow(rem % 60),
            weekday: narrow(weekday),
            yearday: narrow(yearday),
        }
    }

    /// The current UTC time.
    pub(crate) fn now() -> CivilTime {
        let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(before) => -i64::try_from(before.duration().as_secs()).unwrap_or(i64::MAX),
        };
        CivilTime::from_unix(secs)
    }
}

fn name(names: &[&'static str], index: u32) -> &'static str {
    names
        .get(usize::try_from(index).unwrap_or(usize::MAX))
        .copied()
        .unwrap_or("?")
}

fn short(names: &[&'static str], index: u32) -> &'static str {
    let full = name(names, index);
    full.get(..3).unwrap_or(full)
}

/// Formats `t` with a C `strftime` format (see the module docs).
pub(crate) fn strftime(format: &str, t: &CivilTime) -> String {
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
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
        match spec {
            Some('a') => out.push_str(short(&WEEKDAYS, t.weekday)),
            Some('A') => out.push_str(name(&WEEKDAYS, t.weekday)),
            Some('b') | Some('h') => out.push_str(short(&MONTHS, t.month.saturating_sub(1))),
            Some('B') => out.push_str(name(&MONTHS, t.month.saturating_sub(1))),
            Some('d') => num(&mut out, i64::from(t.day), 2),
            Some('e') => {
                let _ = write!(out, "{:>2}", t.day);
            }
            Some('F') => {
                let _ = write!(out, "{:04}-{:02}-{:02}", t.year, t.month, t.day);
            }
            Some('H') => num(&mut out, i64::from(t.hour), 2),
            Some('I') => num(&mut out, i64::from(hour12), 2),
            Some('j') => num(&mut out, i64::from(t.yearday), 3),
            Some('m') => num(&mut out, i64::from(t.month), 2),
            Some('M') => num(&mut out, i64::from(t.minute), 2),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('S') => num(&mut out, i64::from(t.second), 2),
            Some('T') => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            Some('y') => num(&mut out, t.year.rem_euclid(100), 2),
            Some('Y') => num(&mut out, t.year, 4),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_time_matches_known_instants() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!((t.year, t.month, t.day), (2024, 2, 29));
        assert_eq!((t.hour, t.minute, t.second), (13, 5, 9));
        assert_eq!((t.weekday, t.yearday), (3, 60));
        // 1969-12-31T23:59:59Z, one second before the epoch, a Wednesday.
        let t = CivilTime::from_unix(-1);
        assert_eq!((t.year, t.month, t.day, t.hour), (1969, 12, 31, 23));
        assert_eq!((t.weekday, t.yearday), (2, 365));
        // 2000-12-31: day 366 of a leap century year.
        let t = CivilTime::from_unix(978_220_800);
        assert_eq!((t.year, t.month, t.day, t.yearday), (2000, 12, 31, 366));
    }

    #[test]
    fn strftime_writes_the_directives_llama_templates_use() {
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!(strftime("%d %b %Y", &t), "29 Feb 2024");
        assert_eq!(
            strftime("%A, %B %-d, %Y", &t),
            "Thursday, February 29, 2024"
        );
        assert_eq!(
            strftime("%F %T %I%p %j %y %Z%z", &t),
            "2024-02-29 13:05:09 01PM 060 24 UTC+0000"
        );
        assert_eq!(strftime("100%% %q %", &t), "100% %q %");
        let early = CivilTime::from_unix(1_704_070_800); // 2024-01-01T01:00:00Z
        assert_eq!(strftime("%-m/%-d %e|%-H", &early), "1/1  1|1");
    }
}
