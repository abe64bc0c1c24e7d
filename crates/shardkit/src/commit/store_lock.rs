//! One writer per dataset in an object store, across machines.
//!
//! The lock is the object `.shardkit-lock.json` beside the dataset, taken with a conditional
//! PUT (`If-None-Match: *`), which the store grants to one writer only. A background thread
//! renews it every quarter lease (`If-Match` the ETag it last wrote, so a writer whose lock was
//! taken over learns so), and the writer deletes it when it ends. A lock whose holder is gone is
//! taken over, again by a conditional PUT on the ETag seen, so of two writers taking over one
//! wins. A holder is gone when:
//!
//! * on this machine (same host name and boot), its process has exited, or, in this process,
//!   its writer has ended without releasing it (a test's simulated kill);
//! * anywhere, its lease (`SHARDKIT_S3_LOCK_LEASE_S`, 120 s by default) has run out since its
//!   last renewal, by this machine's clock.
//!
//! Before uploading its commit record a writer renews the lock once more, and refuses to commit
//! if it was taken over. `SHARDKIT_S3_LOCK=0` writes without the lock, for stores that refuse
//! conditional writes.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::io::Remote;
use crate::json::{self, Value};

/// The lock object's name, beside the dataset's objects.
pub(crate) const NAME: &str = ".shardkit-lock.json";

/// The tokens of the locks this process holds now.
static HELD: Mutex<Option<HashSet<String>>> = Mutex::new(None);

fn held(f: impl FnOnce(&mut HashSet<String>)) {
    f(HELD
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new))
}

fn held_here(token: &str) -> bool {
    let mut here = false;
    held(|h| here = h.contains(token));
    here
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Who holds a lock: what the lock object says.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holder {
    host: String,
    /// The kernel's boot id and pid namespace ([`machine_id`]), so that a host name reused
    /// after a reboot, or by another container, is not taken for this machine's.
    boot: String,
    pid: u32,
    /// Unique per lock taken.
    token: String,
    renewed: u64,
    lease: u64,
    /// What the holder is, beyond its process (a part's claim: its rank), when it says.
    who: Option<String>,
}

impl Holder {
    fn me() -> Holder {
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let pid = std::process::id();
        Holder {
            host: hostname(),
            boot: machine_id(),
            pid,
            token: format!(
                "{pid:x}-{nanos:x}-{:x}",
                COUNT.fetch_add(1, Ordering::Relaxed)
            ),
            renewed: now_unix(),
            lease: crate::config::s3_lock_lease_s(),
            who: None,
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let v = Value::Object(vec![
            ("shardkit_lock".into(), Value::int(1)),
            ("host".into(), Value::String(self.host.clone())),
            ("boot_id".into(), Value::String(self.boot.clone())),
            ("pid".into(), Value::int(self.pid)),
            ("token".into(), Value::String(self.token.clone())),
            ("renewed_unix".into(), Value::int(self.renewed)),
            ("lease_s".into(), Value::int(self.lease)),
        ]);
        let mut v = v;
        if let Some(who) = &self.who {
            // Only a part's claim says it: the dataset lock's object stays as it was.
            v.set("who", Value::String(who.clone()));
        }
        let mut text = json::to_pretty(&v, 1, json::Escape::Utf8);
        text.push('\n');
        text.into_bytes()
    }

    fn parse(bytes: &[u8]) -> Option<Holder> {
        let v = json::parse(bytes).ok()?;
        if v.get("shardkit_lock")?.as_u64()? != 1 {
            return None;
        }
        Some(Holder {
            host: v.get("host")?.as_str()?.to_string(),
            boot: v.get("boot_id")?.as_str()?.to_string(),
            pid: u32::try_from(v.get("pid")?.as_u64()?).ok()?,
            token: v.get("token")?.as_str()?.to_string(),
            renewed: v.get("renewed_unix")?.as_u64()?,
            lease: v.get("lease_s")?.as_u64()?,
            who: v.get("who").and_then(Value::as_str).map(str::to_string),
        })
    }

    /// Whether the lock `self` describes is abandoned, as seen by `me` at `now`: its lease ran
    /// out, or its holder on this machine is gone (`alive` says whether a pid is running,
    /// `held_here` whether a token is a lock this process holds).
    fn is_gone(
        &self,
        me: &Holder,
        now: u64,
        alive: impl Fn(u32) -> bool,
        held_here: impl Fn(&str) -> bool,
    ) -> bool {
        let expired = now > self.renewed.saturating_add(self.lease);
        let this_machine = self.host == me.host && !me.boot.is_empty() && self.boot == me.boot;
        let gone_here = this_machine
            && if self.pid == me.pid {
                !held_here(&self.token)
            } else {
                !alive(self.pid)
            };
        expired || gone_here
    }

    fn describe(&self, now: u64) -> String {
        let who = self
            .who
            .as_ref()
            .map(|w| format!("{w}, "))
            .unwrap_or_default();
        format!(
            "{who}{} pid {}, lock renewed {} s ago, lease {} s",
            self.host,
            self.pid,
            now.saturating_sub(self.renewed),
            self.lease
        )
    }
}

/// This kernel's boot id and this process's pid namespace: processes that share both see each
/// other's pids (containers on one host share a boot id, not a pid namespace). Empty where
/// either is unknown.
fn machine_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id");
    let pid_ns = std::fs::read_link("/proc/self/ns/pid");
    match (boot, pid_ns) {
        (Ok(b), Ok(ns)) => format!("{}/{}", b.trim(), ns.display()),
        _ => String::new(),
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer we own.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    }
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}

/// The state the writer and the renewing thread share.
#[derive(Debug)]
struct Shared {
    target: Remote,
    /// The lock object's name under `target`.
    name: String,
    holder: Mutex<(Holder, String)>,
    /// Set once a renewal found the lock taken over.
    lost: AtomicBool,
}

impl Shared {
    /// Rewrites the lock with a new renewal time, on the ETag last written.
    fn renew(&self) -> Result<()> {
        let mut g = self.holder.lock().unwrap_or_else(|e| e.into_inner());
        if self.lost.load(Ordering::Relaxed) {
            return Err(self.lost_error());
        }
        let (holder, etag) = &mut *g;
        holder.renewed = now_unix();
        match self
            .target
            .put_if(&self.name, holder.to_bytes(), Some(etag.as_str()))?
        {
            Some(e) => {
                *etag = e;
                Ok(())
            }
            None => {
                self.lost.store(true, Ordering::Relaxed);
                Err(self.lost_error())
            }
        }
    }

    fn lost_error(&self) -> Error {
        Error::LockedRemote {
            path: self.target.url_of(&self.name),
            why: "this writer's lock was taken over by another writer (its renewals stopped \
                  for longer than the lease); nothing more is written, resume the write once \
                  the other writer is stopped"
                .into(),
        }
    }
}

/// A held store lock (or none, with `SHARDKIT_S3_LOCK=0`); dropping it stops the renewals and
/// deletes the lock object.
#[derive(Debug)]
pub(crate) struct StoreLock {
    shared: Option<Arc<Shared>>,
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<std::thread::JoinHandle<()>>,
}

impl StoreLock {
    /// Takes the lock of the dataset at `target`, or fails with [`Error::LockedRemote`]
    /// naming its holder.
    pub(crate) fn acquire(target: &Remote) -> Result<StoreLock> {
        StoreLock::acquire_named(target, NAME, None)
    }

    /// Takes the lock object `name` under `target` (a write in parts' claims and commit lock),
    /// saying `who` holds it when given, as [`StoreLock::acquire`] takes the dataset's.
    pub(crate) fn acquire_named(
        target: &Remote,
        name: &str,
        who: Option<String>,
    ) -> Result<StoreLock> {
        if !crate::config::s3_lock()? {
            return Ok(StoreLock {
                shared: None,
                stop: None,
                renewer: None,
            });
        }
        let me = Holder {
            who,
            ..Holder::me()
        };
        let url = target.url_of(name);
        let unsupported = |e: Error| match e {
            Error::Remote {
                object,
                range,
                message,
            } if message.contains("501") || message.contains("NotImplemented") => Error::Remote {
                object,
                range,
                message: format!(
                    "{message} (taking the writer's lock with a conditional PUT; if this store \
                     does not support conditional writes, set SHARDKIT_S3_LOCK=0 to write \
                     without the lock)"
                ),
            },
            e => e,
        };
        for _ in 0..4 {
            if let Some(etag) = target
                .put_if(name, me.to_bytes(), None)
                .map_err(unsupported)?
            {
                return Self::start(target, name, me, etag);
            }
            let Some((bytes, etag)) = target.get_tagged(name)? else {
                continue; // released meanwhile
            };
            let theirs = Holder::parse(&bytes).ok_or_else(|| {
                Error::format(
                    &url,
                    "is not a shardkit writer's lock; delete it if no writer is writing this \
                     dataset",
                )
            })?;
            let now = now_unix();
            if !theirs.is_gone(&me, now, pid_alive, held_here) {
                return Err(Error::LockedRemote {
                    path: url,
                    why: format!(
                        "another writer ({}) is writing this dataset; wait for it to finish or \
                         stop it (a lock whose lease has run out, or whose process on this \
                         machine has exited, is taken over)",
                        theirs.describe(now)
                    ),
                });
            }
            let Some(etag) = etag else {
                return Err(Error::Remote {
                    object: url.display().to_string(),
                    range: None,
                    message: "the store gave no ETag for the lock object".into(),
                });
            };
            if let Some(etag) = target.put_if(name, me.to_bytes(), Some(&etag))? {
                return Self::start(target, name, me, etag);
            }
            // Another writer took it over first: look again.
        }
        Err(Error::LockedRemote {
            path: url,
            why: "other writers keep taking this dataset's lock; try again".into(),
        })
    }

    /// Takes the lock object `name` under `target`, waiting while a live holder has it (the
    /// commit of a write in parts is one process's at a time; a dead holder's lock is taken
    /// over once its lease runs out, or at once on its machine).
    pub(crate) fn acquire_waiting(
        target: &Remote,
        name: &str,
        who: Option<String>,
    ) -> Result<StoreLock> {
        let mut pause = Duration::from_millis(20);
        loop {
            match StoreLock::acquire_named(target, name, who.clone()) {
                Err(Error::LockedRemote { .. }) => {
                    std::thread::sleep(pause);
                    // Capped low: the holder is usually a rank checking for a moment whether
                    // every unit is durable, and the next rank's commit waits on this.
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }

    /// Who holds the lock object `name` under `target`, when a live holder does: `None` when
    /// it is absent or its holder is gone (then it is taken over by the next
    /// [`StoreLock::acquire_named`]). An object that is no lock is named as such.
    pub(crate) fn live_holder(target: &Remote, name: &str) -> Result<Option<String>> {
        let Some((bytes, _)) = target.get_tagged(name)? else {
            return Ok(None);
        };
        let now = now_unix();
        Ok(match Holder::parse(&bytes) {
            None => Some(format!(
                "{} is not a shardkit lock; delete it if no writer is writing",
                target.url_of(name).display()
            )),
            Some(h) if h.is_gone(&Holder::me(), now, pid_alive, held_here) => None,
            Some(h) => Some(h.describe(now)),
        })
    }

    fn start(target: &Remote, name: &str, me: Holder, etag: String) -> Result<StoreLock> {
        held(|h| {
            h.insert(me.token.clone());
        });
        // Saturating: a lease of any length renews without overflowing.
        let period = Duration::from_millis(me.lease.saturating_mul(1000) / 4);
        let shared = Arc::new(Shared {
            target: target.clone(),
            name: name.to_string(),
            holder: Mutex::new((me, etag)),
            lost: AtomicBool::new(false),
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let renewing = shared.clone();
        let mut lock = StoreLock {
            shared: Some(shared),
            stop: Some(stop),
            renewer: None,
        };
        // On failure the lock is dropped, which deletes it.
        let renewer = std::thread::Builder::new()
            .name("shardkit-lock".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(period) {
                    // A failed renewal is tried again next period; a lost lock stops them.
                    if renewing.renew().is_err() && renewing.lost.load(Ordering::Relaxed) {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Thread {
                what: "the lock renewal thread shardkit-lock".into(),
                source: e,
            })?;
        lock.renewer = Some(renewer);
        Ok(lock)
    }

    /// Fails if a renewal found the lock taken over (no request).
    pub(crate) fn check(&self) -> Result<()> {
        self.watch().check()
    }

    /// A handle the writer's upload threads check before each request.
    pub(crate) fn watch(&self) -> LockWatch {
        LockWatch(self.shared.clone())
    }

    /// Renews the lock now (before a commit record): fails if it was taken over.
    pub(crate) fn confirm(&self) -> Result<()> {
        match &self.shared {
            Some(s) => s.renew(),
            None => Ok(()),
        }
    }

    /// The lock object's URL, when a lock is held.
    #[cfg(test)]
    fn url(&self) -> Option<std::path::PathBuf> {
        self.shared.as_ref().map(|s| s.target.url_of(&s.name))
    }
}

/// Tells whether a [`StoreLock`] was taken over (none: never).
#[derive(Debug, Clone, Default)]
pub(crate) struct LockWatch(Option<Arc<Shared>>);

impl LockWatch {
    /// Fails if a renewal found the lock taken over (no request).
    pub(crate) fn check(&self) -> Result<()> {
        match &self.0 {
            Some(s) if s.lost.load(Ordering::Relaxed) => Err(s.lost_error()),
            _ => Ok(()),
        }
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
        if let Some(s) = self.shared.take() {
            let token = {
                let g = s.holder.lock().unwrap_or_else(|e| e.into_inner());
                g.0.token.clone()
            };
            // Never delete a lock another writer took over.
            if !s.lost.load(Ordering::Relaxed) {
                let _ = s.target.delete(&s.name);
            }
            held(|h| {
                h.remove(&token);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(host: &str, boot: &str, pid: u32, token: &str, renewed: u64) -> Holder {
        Holder {
            host: host.into(),
            boot: boot.into(),
            pid,
            token: token.into(),
            renewed,
            lease: 120,
            who: None,
        }
    }

    #[test]
    fn the_lock_object_round_trips() {
        let h = holder("node-7", "b00t", 4242, "t-1", 1_700_000_000);
        assert_eq!(Holder::parse(&h.to_bytes()), Some(h.clone()));
        // A part's claim says which rank holds it; the dataset's lock says nothing more.
        assert!(!String::from_utf8_lossy(&h.to_bytes()).contains("who"));
        let claim = Holder {
            who: Some("rank 1 of 3".into()),
            ..h
        };
        assert_eq!(Holder::parse(&claim.to_bytes()), Some(claim.clone()));
        assert!(claim
            .describe(claim.renewed)
            .starts_with("rank 1 of 3, node-7 pid 4242"));
        assert_eq!(Holder::parse(b"{\"shardkit_lock\": 2}"), None);
        assert_eq!(Holder::parse(b"not json"), None);
    }

    #[test]
    fn a_lock_is_taken_over_only_when_its_holder_is_gone() {
        let me = holder("node-1", "boot-a", 100, "mine", 1000);
        let alive = |p: u32| p == 200;
        let none_held = |_: &str| false;
        // Another machine: only an expired lease frees it.
        let other = holder("node-2", "boot-b", 200, "t", 1000);
        assert!(!other.is_gone(&me, 1000 + 120, alive, none_held));
        assert!(other.is_gone(&me, 1000 + 121, alive, none_held));
        // This machine: a live process keeps it, an exited one frees it at once.
        let here_live = holder("node-1", "boot-a", 200, "t", 1000);
        assert!(!here_live.is_gone(&me, 1001, alive, none_held));
        let here_dead = holder("node-1", "boot-a", 300, "t", 1000);
        assert!(here_dead.is_gone(&me, 1001, alive, none_held));
        // The same host name after a reboot (or in another container) is another machine.
        let rebooted = holder("node-1", "boot-z", 300, "t", 1000);
        assert!(!rebooted.is_gone(&me, 1001, alive, none_held));
        // This process: a lock it still holds is in use; one it no longer holds is not.
        let ours = holder("node-1", "boot-a", 100, "t", 1000);
        assert!(!ours.is_gone(&me, 1001, alive, |t: &str| t == "t"));
        assert!(ours.is_gone(&me, 1001, alive, none_held));
        // Without a boot id nothing is known of the machine: only the lease counts.
        let me_unknown = holder("node-1", "", 100, "mine", 1000);
        let blank = holder("node-1", "", 300, "t", 1000);
        assert!(!blank.is_gone(&me_unknown, 1001, alive, none_held));
    }

    #[test]
    fn this_process_is_alive_and_a_lock_disabled_holds_nothing() {
        assert!(pid_alive(std::process::id()));
        std::env::set_var("SHARDKIT_S3_LOCK", "0");
        let r = Remote::parse(std::path::Path::new("s3://bucket/prefix")).unwrap();
        let lock = StoreLock::acquire(&r).unwrap();
        std::env::remove_var("SHARDKIT_S3_LOCK");
        assert_eq!(lock.url(), None);
        lock.check().unwrap();
        lock.confirm().unwrap();
    }
}
