//! The event loop a VM runs under, with its API socket: what `serve`, `restore`, `receive` and
//! `boot` share. The loop (`lifecycle`'s) carries SIGINT/SIGTERM, vCPUs stopping, the API
//! socket's clients and whatever a guest kind adds (a Linux guest's console); after each round
//! the job says whether the run has ended, so each guest kind keeps its own endings while the
//! loop and the socket are set up and served one way.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use event_manager::MutEventSubscriber;

use crate::api::metrics::Labelled;
use crate::api::server::{ApiServer, ApiSocket, SocketFile};
use crate::control::Apply;
use crate::lifecycle::{Ending, EventLoop, JobContext, LoopError};

/// A VM's event loop and, once [`RunLoop::serve`] was called, its API socket, served by a
/// controller of type `C`. The socket's file goes when the loop is dropped.
pub(crate) struct RunLoop<C> {
    event_loop: EventLoop,
    api: Option<(Arc<Mutex<ApiServer<C>>>, SocketFile)>,
}

impl<C> std::fmt::Debug for RunLoop<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunLoop")
            .field("event_loop", &self.event_loop)
            .field("serving", &self.api.is_some())
            .finish()
    }
}

impl<C: Apply + Send + 'static> RunLoop<C> {
    /// Creates the event loop (and routes SIGINT and SIGTERM to it); no API socket yet.
    pub(super) fn new() -> Result<Self, LoopError> {
        Ok(RunLoop {
            event_loop: EventLoop::new()?,
            api: None,
        })
    }

    /// What vCPUs and jobs share with the loop.
    pub(super) fn context(&self) -> &JobContext {
        self.event_loop.context()
    }

    /// Adds a guest kind's own subscriber.
    pub(super) fn add(&mut self, subscriber: Arc<Mutex<dyn MutEventSubscriber + Send>>) {
        self.event_loop.add(subscriber);
    }

    /// Serves `controller` on `socket` from now on; a client silent for `idle_timeout` is
    /// answered 408 and closed.
    pub(super) fn serve(&mut self, socket: ApiSocket, controller: C, idle_timeout: Duration) {
        let ApiSocket { listener, file } = socket;
        let server = Arc::new(Mutex::new(
            ApiServer::new(listener, controller)
                .with_idle_timeout(idle_timeout)
                .with_counters(exit_counters),
        ));
        self.event_loop.add(server.clone());
        self.api = Some((server, file));
    }

    /// Dispatches events, waiting at most `wait_ms()` milliseconds a round, until a signal comes
    /// (`None`) or `ended`, asked after every round with the controller (if one serves the
    /// socket), says how the run ended.
    pub(super) fn run<E>(
        &mut self,
        mut wait_ms: impl FnMut() -> i32,
        mut ended: impl FnMut(Option<&mut C>) -> Option<E>,
    ) -> Option<E> {
        let stop = Arc::clone(&self.event_loop.context().stop);
        loop {
            if self.event_loop.dispatch(wait_ms()) == Some(Ending::Interrupted)
                || stop.load(Ordering::Acquire)
            {
                return None;
            }
            let ending = match &self.api {
                Some((server, _)) => {
                    let mut server = server.lock().unwrap_or_else(|p| p.into_inner());
                    ended(Some(server.controller_mut()))
                }
                None => ended(None),
            };
            if ending.is_some() {
                return ending;
            }
        }
    }

    /// The run is ending: has the controller cut short every request still waiting for the
    /// guest (a command under way) and keeps the loop going until their answers are out, for
    /// at most `within`; those still without an answer then get a 503.
    pub(super) fn finish_deferred(&mut self, within: Duration) {
        let Some((server, _)) = &self.api else {
            return;
        };
        let server = Arc::clone(server);
        let lock = || server.lock().unwrap_or_else(|p| p.into_inner());
        lock().controller_mut().cut_short();
        let deadline = Instant::now() + within;
        while lock().waiting() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // The controller's notifier wakes the loop when an answer is ready.
            let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1);
            self.event_loop.dispatch(ms);
        }
        lock().abandon_waiting(&format!(
            "the VMM stopped before the guest's command ended (waited {within:?} for it)"
        ));
    }

    /// Calls `f` with the controller serving the socket, if one does.
    pub(super) fn with_controller<R>(&self, f: impl FnOnce(&mut C) -> R) -> Option<R> {
        let (server, _) = self.api.as_ref()?;
        let mut server = server.lock().unwrap_or_else(|p| p.into_inner());
        Some(f(server.controller_mut()))
    }
}

/// The vCPUs' exits for `GET /metrics` ([`crate::vm::vcpu::exit_totals`]).
fn exit_counters() -> Vec<Labelled> {
    let totals = crate::vm::vcpu::exit_totals();
    vec![
        Labelled {
            name: "tinyvmm_vcpu_exits_total",
            help: "vCPU exits (KVM_RUN returns) by kind, of every vCPU the VMM started.",
            label: "kind",
            values: totals.by_kind,
        },
        Labelled {
            name: "tinyvmm_vcpu_exits_handled_total",
            help: "vCPU exits the exit loop handled its own way: writes to read-only memory \
                   dropped, accesses to absent memory, accesses completed after a slot change, \
                   instructions KVM could not emulate run again after one or, with none, \
                   answered with #UD in guest user mode, faults on unreachable memory after \
                   which its slot went.",
            label: "how",
            values: totals.handled,
        },
    ]
}
