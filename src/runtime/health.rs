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
pub(crate) async fn serve(port: u16, liveness: Liveness) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
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
    Ok(addr)
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
        let port = serve(0, liveness.clone()).await.unwrap().port();
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
