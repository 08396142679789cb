//! What SQS might do, where the Developer Guide says it might, drawn per run:
//! half the runs have none of it, the others each class on or off at a rate.
//! The model draws its choices from its own generator, seeded from the run's
//! dice, so a seed replays the same run (and a run with all of it off draws
//! nothing more from the dice than the one seed).

use std::sync::{Arc, Mutex};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqs_once::testkit::queue::Might;

use crate::faults::Dice;

/// The rates drawn for one run (see [`Might`]), and SQS calls that land late.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MightPlan {
    /// [`Might::twice`].
    pub twice: f64,
    /// [`Might::again_after_delete`].
    pub again_after_delete: f64,
    /// [`Might::fewer`].
    pub fewer: f64,
    /// [`Might::unordered`].
    pub unordered: f64,
    /// [`Might::old_handle_deletes`].
    pub old_handle_deletes: f64,
    /// [`Might::expired_fifo_handles`].
    pub expired_fifo_handles: bool,
    /// [`Might::entry_errors`].
    pub entry_errors: f64,
    /// A delete or visibility change the client gives up on (a timeout) and
    /// SQS applies later (in `FaultyQueue`).
    pub late: f64,
    /// The model's generator's seed.
    pub seed: u64,
}

impl MightPlan {
    /// Nothing unkind.
    pub const OFF: Self = Self {
        twice: 0.0,
        again_after_delete: 0.0,
        fewer: 0.0,
        unordered: 0.0,
        old_handle_deletes: 0.0,
        expired_fifo_handles: false,
        entry_errors: 0.0,
        late: 0.0,
        seed: 0,
    };

    /// Draws a run's plan.
    pub fn draw(dice: &Dice) -> Self {
        if dice.chance(0.5) {
            return Self::OFF;
        }
        let on = |lo: f64, hi: f64| {
            if dice.chance(0.5) {
                dice.rate(lo, hi)
            } else {
                0.0
            }
        };
        Self {
            twice: on(0.01, 0.1),
            again_after_delete: on(0.01, 0.1),
            fewer: on(0.1, 0.5),
            unordered: on(0.1, 0.5),
            old_handle_deletes: on(0.2, 1.0),
            expired_fifo_handles: dice.chance(0.5),
            entry_errors: on(0.01, 0.1),
            late: on(0.01, 0.05),
            seed: dice.int(0, u64::MAX),
        }
    }

    /// The model's settings.
    pub fn model(&self) -> Might {
        let mut rng = StdRng::seed_from_u64(self.seed);
        Might {
            twice: self.twice,
            again_after_delete: self.again_after_delete,
            fewer: self.fewer,
            unordered: self.unordered,
            old_handle_deletes: self.old_handle_deletes,
            expired_fifo_handles: self.expired_fifo_handles,
            entry_errors: self.entry_errors,
            draw: Some(Arc::new(Mutex::new(move || rng.random_range(0.0..1.0)))),
        }
    }

    /// For the scenario's line: the classes on, or "off".
    pub fn summary(&self) -> String {
        let rates = [
            ("twice", self.twice),
            ("again after delete", self.again_after_delete),
            ("fewer", self.fewer),
            ("unordered", self.unordered),
            ("old handle deletes", self.old_handle_deletes),
            ("batch entry errors", self.entry_errors),
            ("late SQS", self.late),
        ];
        let mut on: Vec<String> = rates
            .iter()
            .filter(|(_, p)| *p > 0.0)
            .map(|(name, p)| format!("{name} {p:.3}"))
            .collect();
        if self.expired_fifo_handles {
            on.push("expired FIFO handles".into());
        }
        if on.is_empty() {
            "off".into()
        } else {
            on.join(", ")
        }
    }
}
