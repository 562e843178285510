-- Q3 as a regular join with a state TTL of 10 s: who sells in category 10 in Oregon, Idaho or
-- California, for auctions opened less than 10 s of event time from the seller's registration.
SELECT P.name, P.city, P.state, A.id AS auction
FROM auction AS A JOIN person AS P ON A.seller = P.id
WHERE A.category = 10 AND P.state IN ('OR', 'ID', 'CA')
  AND abs(A.event_time - P.event_time) < 10000000
