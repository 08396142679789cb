//! Faults around any handler, for tests and chaos runs: [`Faulty`] adds slow
//! work, panics and a pause after the effect to a handler without touching it.

use std::time::Duration;

use crate::protocol::key::sha256_hex;
use crate::{Context, Effects, Handler, HandlerResult, Message};

/// A handler with faults injected around it. Each fault is chosen from the
/// message's body (and, for panics, the attempt), so a run can be repeated and
/// a retry usually takes another path.
///
/// ```
/// use std::time::Duration;
/// use sqs_once::testkit::Faulty;
/// use sqs_once::handler_fn;
///
/// let ship = handler_fn(|_message, _ctx| async { Ok(None) });
/// // A third of the messages take 2 s; about 1 % of attempts panic.
/// let handler = Faulty::new(ship)
///     .work(Duration::from_secs(2))
///     .slow_percent(33)
///     .panic_percent(1);
/// # let _ = handler;
/// ```
#[derive(Debug, Clone)]
pub struct Faulty<H> {
    inner: H,
    work: Duration,
    slow_percent: u8,
    panic_percent: u8,
    pause_after: Duration,
}

impl<H: Handler> Faulty<H> {
    /// `inner` with no faults yet.
    pub fn new(inner: H) -> Self {
        Self {
            inner,
            work: Duration::ZERO,
            slow_percent: 100,
            panic_percent: 0,
            pause_after: Duration::ZERO,
        }
    }

    /// Waits this long before the handler runs (a slow downstream call), to
    /// watch heartbeats, crashes and shutdown mid-handler.
    pub fn work(mut self, work: Duration) -> Self {
        self.work = work;
        self
    }

    /// Spends the [`work`](Self::work) time on about `percent` % of messages
    /// only (chosen by body, the same on every attempt), so the messages of
    /// one batch finish in another order than they started.
    pub fn slow_percent(mut self, percent: u8) -> Self {
        self.slow_percent = percent.min(100);
        self
    }

    /// Panics before the handler runs on about `percent` % of attempts (chosen
    /// by body and attempt, so a retry usually succeeds).
    pub fn panic_percent(mut self, percent: u8) -> Self {
        self.panic_percent = percent.min(100);
        self
    }

    /// Waits this long after the handler returned (with success or not) and
    /// before the runtime records its outcome: a window in which to crash the
    /// consumer between an external effect and its completion. (A
    /// [`StagedOnly`](Effects::StagedOnly) handler's writes commit with that
    /// record, after the pause.)
    pub fn pause_after(mut self, pause: Duration) -> Self {
        self.pause_after = pause;
        self
    }

    /// Whether the first byte of `roll` (a hex digest) falls within `percent` %.
    fn within(roll: &str, percent: u8) -> bool {
        u8::from_str_radix(&roll[..2], 16).unwrap_or(255) % 100 < percent
    }
}

impl<H: Handler> Handler for Faulty<H> {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        if self.panic_percent > 0 {
            let mut seed = message.body().as_bytes().to_vec();
            seed.extend_from_slice(format!("#{}", ctx.attempt()).as_bytes());
            if Self::within(&sha256_hex(&seed), self.panic_percent) {
                panic!("simulated handler bug (Faulty::panic_percent)");
            }
        }
        if !self.work.is_zero()
            && Self::within(&sha256_hex(message.body().as_bytes()), self.slow_percent)
        {
            tokio::time::sleep(self.work).await;
        }
        let result = self.inner.handle(message, ctx).await;
        if !self.pause_after.is_zero() {
            tokio::time::sleep(self.pause_after).await;
        }
        result
    }

    fn effects(&self) -> Effects {
        self.inner.effects()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler_fn;

    async fn done(_: Message, _: Context) -> HandlerResult {
        Ok(Some(serde_json::json!("done")))
    }

    fn message(body: &str) -> Message {
        Message::new("m-1", body)
    }

    fn ctx() -> Context {
        Context::new("c", Some("k"), (1, 1), &message("a"), 1024)
    }

    #[tokio::test(start_paused = true)]
    async fn work_is_spent_only_on_the_slow_share_and_the_answer_is_the_inner_one() {
        let all = Faulty::new(handler_fn(done)).work(Duration::from_secs(5));
        let started = tokio::time::Instant::now();
        let answer = all.handle(&message("a"), &ctx()).await;
        assert_eq!(answer.unwrap(), Some(serde_json::json!("done")));
        assert_eq!(started.elapsed(), Duration::from_secs(5));

        let none = Faulty::new(handler_fn(done))
            .work(Duration::from_secs(5))
            .slow_percent(0);
        let started = tokio::time::Instant::now();
        none.handle(&message("a"), &ctx()).await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn the_pause_comes_after_the_handler() {
        let h = Faulty::new(handler_fn(done)).pause_after(Duration::from_secs(3));
        let started = tokio::time::Instant::now();
        h.handle(&message("a"), &ctx()).await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test]
    #[should_panic(expected = "simulated handler bug")]
    async fn every_attempt_panics_at_one_hundred_percent() {
        let h = Faulty::new(handler_fn(done)).panic_percent(100);
        let _ = h.handle(&message("a"), &ctx()).await;
    }

    #[test]
    fn effects_are_the_inner_handlers() {
        let staged = Faulty::new(crate::staged_only(handler_fn(done)));
        assert_eq!(staged.effects(), Effects::StagedOnly);
        assert_eq!(Faulty::new(handler_fn(done)).effects(), Effects::External);
    }
}
