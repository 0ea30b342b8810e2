//! The lifecycle of inference workers, with load counted by ownership.
//!
//! Workers with one persistent identity per registration generation, owning
//! load guards that release exactly once, circuit breakers, health checks that
//! never touch load, a service registry with generations and expiry,
//! role-separated discovery pools with serialized reconciliation, retry
//! policies with budgets, and graceful drain. No HTTP: probes and clocks come
//! in through small traits. The implementation lands with its own issue; this
//! page says what it will hold.
#![warn(missing_docs)]
