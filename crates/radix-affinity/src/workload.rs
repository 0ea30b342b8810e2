//! Workload generator.
