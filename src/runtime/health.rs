//! The poller's health check, for a container without a shell (`--health`):
//! answered by any binary that runs the front door ([`crate::SqsOnce`]) and by
//! the `env` feature's [`crate::env::run`].
//!
//! With `SQS_ONCE_HEALTH_PORT` set, a running poller answers on
//! `127.0.0.1:PORT` with how long ago its receive loop last turned, in
//! milliseconds (`none` before the first turn), and closes. The same binary
//! started with `--health` asks it and exits 0 only when that is within
//! `SQS_ONCE_HEALTH_MAX_AGE`: a poller whose loop is stuck, or whose runtime
//! no longer answers, is reported unhealthy and its task replaced.

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
#[cfg(feature = "env")]
use std::process::ExitCode;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::runtime::poller::Liveness;

/// How long `--health` waits for the poller's answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(3);

/// Answers every connection on `127.0.0.1:port` with the liveness's age.
/// Binds before it returns; the server runs until the process exits.
pub(crate) async fn serve(port: u16, liveness: Liveness) -> std::io::Result<Serving> {
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                // Out of file handles, say: not a loop at full speed.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let answer = match liveness.since_last_beat() {
                Some(age) => format!("{}\n", age.as_millis()),
                None => "none\n".to_owned(),
            };
            tokio::spawn(async move {
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    Ok(Serving { addr, task })
}

/// A health answer being served; dropping it closes the port (so a poller
/// started again in the same process can listen on it).
pub(crate) struct Serving {
    #[cfg_attr(not(test), allow(dead_code))]
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    /// The port it answers on.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Asks the poller at `127.0.0.1:port`: `Ok(age)` of its last turn, or why
/// it is not healthy.
pub(crate) fn ask(port: u16, max_age: Duration) -> Result<Duration, String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut conn = TcpStream::connect_timeout(&addr, ANSWER_WITHIN)
        .map_err(|e| format!("no poller answers on {addr}: {e}"))?;
    conn.set_read_timeout(Some(ANSWER_WITHIN))
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .map_err(|e| format!("the poller on {addr} did not answer: {e}"))?;
    let answer = answer.trim();
    if answer == "none" {
        return Err("the poller has not started receiving".into());
    }
    let age = answer
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| format!("unexpected answer from {addr}: {answer:?}"))?;
    if age > max_age {
        return Err(format!(
            "the receive loop last turned {age:?} ago (more than SQS_ONCE_HEALTH_MAX_AGE, {max_age:?})"
        ));
    }
    Ok(age)
}

/// `--health`: exit 0 when the poller on `port` is alive, 1 (with the reason
/// on stderr) when not.
#[cfg(feature = "env")]
pub(crate) fn check(port: u16, max_age: Duration) -> ExitCode {
    match ask(port, max_age) {
        Ok(age) => {
            println!("healthy: the receive loop last turned {age:?} ago");
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("unhealthy: {why}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ask_off_thread(port: u16, max_age: Duration) -> Result<Duration, String> {
        tokio::task::spawn_blocking(move || ask(port, max_age))
            .await
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_recent_beat_is_healthy_and_none_or_an_old_one_is_not() {
        let liveness = Liveness::new();
        let serving = serve(0, liveness.clone()).await.unwrap();
        let port = serving.port();
        let before = ask_off_thread(port, Duration::from_secs(60)).await;
        assert_eq!(before, Err("the poller has not started receiving".into()));
        liveness.beat();
        tokio::time::advance(Duration::from_secs(59)).await;
        let age = ask_off_thread(port, Duration::from_secs(60)).await;
        assert_eq!(age, Ok(Duration::from_secs(59)));
        tokio::time::advance(Duration::from_secs(2)).await;
        let stale = ask_off_thread(port, Duration::from_secs(60)).await;
        assert!(
            stale
                .as_ref()
                .is_err_and(|e| e.contains("SQS_ONCE_HEALTH_MAX_AGE")),
            "{stale:?}"
        );
    }

    /// A poller started again in one process (after a start-up error, or a
    /// second front door once the first returned) can answer on the port.
    #[tokio::test]
    async fn a_dropped_answer_frees_its_port() {
        let first = serve(0, Liveness::new()).await.unwrap();
        let port = first.port();
        assert!(
            serve(port, Liveness::new()).await.is_err(),
            "the port is taken"
        );
        drop(first);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let again = loop {
            match serve(port, Liveness::new()).await {
                Ok(again) => break again,
                Err(e) => {
                    assert!(tokio::time::Instant::now() < deadline, "still taken: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        assert_eq!(again.port(), port);
    }

    #[tokio::test]
    async fn no_poller_listening_is_unhealthy() {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let answer = ask_off_thread(port, Duration::from_secs(60)).await;
        assert!(
            answer
                .as_ref()
                .is_err_and(|e| e.contains("no poller answers")),
            "{answer:?}"
        );
        assert_eq!(check(port, Duration::from_secs(60)), ExitCode::FAILURE);
    }
}
