//! Fuzzing entry points (filled in below).
