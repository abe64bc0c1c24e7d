//! Work split over scoped threads, with the one rule every caller needs: a worker that panics
//! is an error the caller returns, never a shorter result.

use crate::error::{Error, Result};

/// Runs `f` on `items` cut into at most `width` contiguous chunks, one scoped thread a chunk,
/// and returns the outputs concatenated in the items' order. One chunk runs on this thread.
/// The first error in order is returned (after every worker has ended); a worker that
/// panicked becomes [`Error::Internal`] saying it was `what` (`"reading the unit records of
/// s3://b/x"`).
pub(crate) fn chunked<T: Sync, R: Send>(
    items: &[T],
    width: usize,
    what: &str,
    f: impl Fn(&[T]) -> Result<Vec<R>> + Sync,
) -> Result<Vec<R>> {
    let per = items.len().div_ceil(width.max(1)).max(1);
    if items.len() <= per {
        return f(items);
    }
    let f = &f;
    let parts: Vec<Result<Vec<R>>> = std::thread::scope(|s| {
        let workers: Vec<_> = items.chunks(per).map(|c| s.spawn(move || f(c))).collect();
        workers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| {
                    Err(Error::Internal(format!(
                        "internal: a thread {what} panicked"
                    )))
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(items.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_returns_the_first_error_and_turns_a_panic_into_one() {
        let items: Vec<u32> = (0..100).collect();
        let doubled = chunked(&items, 7, "doubling", |c| {
            Ok(c.iter().map(|x| x * 2).collect())
        });
        assert_eq!(
            doubled.unwrap(),
            (0..100).map(|x| x * 2).collect::<Vec<_>>()
        );
        let failed = chunked(&items, 7, "checking", |c| {
            match c.iter().find(|&&x| x == 40 || x == 90) {
                Some(x) => Err(Error::Invalid(format!("{x}"))),
                None => Ok(vec![()]),
            }
        });
        assert_eq!(failed.unwrap_err().to_string(), "40");
        let panicked = chunked(&items, 4, "summing its chunk", |c| {
            if c.contains(&60) {
                panic!("a worker's bug");
            }
            Ok(vec![c.len()])
        });
        let e = panicked.unwrap_err();
        assert!(matches!(e, Error::Internal(_)), "{e:?}");
        assert!(
            e.to_string()
                .contains("a thread summing its chunk panicked"),
            "{e}"
        );
    }
}
